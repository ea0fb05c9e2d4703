"""What the Redis fault and differential tests share: the consumer drivers (sync and
asyncio from one test body), effect counting, our own connections by client name,
pending counts, and the fault lines."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from reliability_harness import record_fault
from server_faults import quiet  # noqa: F401  # re-exported: fault files use it by name

from msgpatterns import Consumer
from msgpatterns.aio.consumer import AsyncConsumer
from msgpatterns.message import Message
from msgpatterns.retry import Backoff, RetryPolicy
from msgpatterns.testing import services

redis = pytest.importorskip("redis")

POLICY = RetryPolicy(max_attempts=1000, backoff=Backoff.fixed(0.05), local_retries=0)


def report(name: str, messages: int, faults: int, lost: int, doubled: int,
           stranded: int, seconds: float) -> None:
    """One fault line: into the session's reliability totals (with ``stranded`` and
    the seconds to recover) and the test's captured output."""
    record_fault(f"fault: {name}", messages, faults, lost, doubled,
                 stranded=stranded, recover=seconds)
    print(f"fault: {name} messages={messages} faults={faults} lost={lost} "
          f"doubled={doubled} stranded={stranded} seconds={seconds:.2f}")


@pytest.fixture
def admin(unique: str) -> Iterator[Any]:
    client = redis.Redis.from_url(services.require("redis"),
                                  client_name=f"faults-admin-{unique}")
    yield client
    client.close()


def with_client_name(url: str, name: str) -> str:
    return f"{url}{'&' if '?' in url else '?'}client_name={name}"


def kill_named(admin: Any, name: str) -> int:
    """CLIENT KILL every connection named ``name`` (ours only); how many died."""
    killed = 0
    for client in admin.client_list():
        if client.get("name") == name:
            with contextlib.suppress(redis.RedisError):  # already gone
                killed += int(admin.client_kill_filter(_id=client["id"]) or 0)
    return killed


class Effects:
    """Effects per key, and a condition to wait for a count of them."""

    def __init__(self) -> None:
        self.count: collections.Counter[str] = collections.Counter()
        self.cond = threading.Condition()

    def applied(self, key: str) -> None:
        with self.cond:
            self.count[key] += 1
            self.cond.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Until ``predicate()`` holds: checked at each effect and every 20 ms (acks
        and broker state change without telling this object)."""
        give_up = time.monotonic() + timeout
        with self.cond:
            while not predicate():
                left = give_up - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.02))
            return True

    def doubled(self) -> int:
        return sum(n - 1 for n in self.count.values() if n > 1)


class Driver:
    """A consumer on a thread of its own: ``Consumer`` as it is, ``AsyncConsumer`` on
    an event loop running in that thread. ``make(driver)`` builds the handler."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.consumer: Any = None

    @property
    def is_async(self) -> bool:
        return self.kind == "async"

    def start(self, build: Callable[[], Any]) -> None:
        if not self.is_async:
            self.consumer = build()
            self.consumer.start()
            return
        started = threading.Event()

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)

            async def begin() -> None:
                self.consumer = build()
                await self.consumer.start()
                started.set()

            self.loop.run_until_complete(begin())
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="async-driver", daemon=True)
        self.thread.start()
        assert started.wait(30), "the AsyncConsumer did not start"

    def call(self, fn: Callable[[], Any], timeout: float = 60) -> Any:
        """``fn()`` (a coroutine for the async driver: run on its loop)."""
        if not self.is_async:
            return fn()
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    def stop(self, timeout: float = 10) -> None:
        self.call(lambda: self.consumer.stop(timeout))

    def finish(self) -> None:
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            assert self.thread is not None
            self.thread.join(30)
            self.loop.close()


def redis_address() -> tuple[str, int, int]:
    """Host, port and database of the Redis the tests use."""
    from urllib.parse import urlsplit

    parts = urlsplit(services.require("redis"))
    return (parts.hostname or "127.0.0.1", parts.port or 6379,
            int(parts.path.strip("/") or 0))


def pending_of(admin: Any, topic: str, group: str, consumer: str | None = None) -> int:
    """Deliveries pending in ``group`` on ``topic`` and its retry stream (under
    ``consumer`` only, when given)."""
    total = 0
    for stream in (topic, f"{topic}:retry:{group}"):
        if not admin.exists(stream):
            continue
        if consumer is None:
            total += int(admin.xpending(stream, group)["pending"])
        else:
            total += len(admin.xpending_range(stream, group, min="-", max="+", count=100000,
                                              consumername=consumer))
    return total


def drop_streams(admin: Any, topic: str, group: str) -> None:
    admin.delete(topic, f"{topic}:retry:{group}", f"{topic}:delayed:{group}", f"{topic}:dlq")


def build_consumer(driver: Driver, url: str, topic: str, handle_sync: Callable[[Message], None],
                   *, read_ahead: bool = True, consumer: str | None = None,
                   workers: int = 4, slow: float = 0.0, policy: RetryPolicy = POLICY,
                   fetch_batch: int = 64, **options: Any) -> tuple[Callable[[], Any], list[Any]]:
    """``build`` for ``driver.start`` (a broker on ``url`` with ``options`` and a
    consumer of group "g" whose handler calls ``handle_sync``) and the list the broker
    lands in."""
    from msgpatterns.aio.redis_streams import AsyncRedisStreamsBroker
    from msgpatterns.brokers.redis_streams import RedisStreamsBroker

    brokers: list[Any] = []
    if driver.is_async:
        async def handle_async(message: Message) -> None:
            if slow:
                await asyncio.sleep(slow)
            handle_sync(message)

        def build() -> Any:
            broker = AsyncRedisStreamsBroker(url, consumer=consumer, **options)
            brokers.append(broker)
            return AsyncConsumer(broker, handle_async, topics=[topic], group="g",
                                 max_in_flight=workers * 8, retry=policy, poll_timeout=0.05,
                                 fetch_batch=fetch_batch)
        return build, brokers

    def handle(message: Message) -> None:
        if slow:
            time.sleep(slow)
        handle_sync(message)

    def build_sync() -> Any:
        broker = RedisStreamsBroker(url, consumer=consumer, read_ahead=read_ahead, **options)
        brokers.append(broker)
        return Consumer(broker, handle, topics=[topic], group="g", workers=workers,
                        retry=policy, poll_timeout=0.05, fetch_batch=fetch_batch)
    return build_sync, brokers


def close_broker(driver: Driver, broker: Any) -> None:
    driver.call(broker.close)


