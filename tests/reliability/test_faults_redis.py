"""Redis faults from the outside, both drivers from one test body.

* ``CLIENT KILL`` of the checker's own connections while they sit idle (found by their
  client name in ``CLIENT LIST``; other agents share this server): no command may
  hang on a dead connection.
* A lost ``XREADGROUP`` reply (a TCP proxy between the broker and Redis forwards the
  request, drops the reply and closes): the consumer reads its own pending entries
  again, so nothing stays pending after the drain.
* ``stop()`` and ``close()`` raced from two threads: whatever order they come in,
  nothing stays pending under the closed consumer.

Each run is one fault line of the reliability totals: messages, faults, lost, doubled,
stranded (pending on the broker after the run, without waiting for any visibility
timeout) and the seconds the run took.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from reliability_harness import record_fault

from msgpatterns import Consumer, InMemoryBroker, idempotent
from msgpatterns.aio.consumer import AsyncConsumer
from msgpatterns.aio.memory import AsyncInMemoryBroker
from msgpatterns.message import Message
from msgpatterns.retry import Backoff, RetryPolicy
from msgpatterns.testing import services

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]

redis = pytest.importorskip("redis")

POLICY = RetryPolicy(max_attempts=1000, backoff=Backoff.fixed(0.05), local_retries=0)


def report(name: str, messages: int, faults: int, lost: int, doubled: int,
           stranded: int, seconds: float) -> None:
    """One fault line: into the session's reliability totals (with ``stranded`` and
    the seconds when the harness takes them) and the test's captured output."""
    extra = {"stranded": stranded, "seconds": seconds}
    accepted = inspect.signature(record_fault).parameters
    record_fault(f"fault: {name}", messages, faults, lost, doubled,
                 **{k: v for k, v in extra.items() if k in accepted})
    print(f"fault: {name} messages={messages} faults={faults} lost={lost} "
          f"doubled={doubled} stranded={stranded} seconds={seconds:.2f}")


@pytest.fixture
def quiet() -> Iterator[None]:
    logger = logging.getLogger("msgpatterns")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


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


DRIVERS = ["sync", "async"]


# -- hole 4: the checker's connections killed while idle ---------------------------------


@pytest.mark.parametrize("built_from", ["url", "client"])
@pytest.mark.parametrize("kind", DRIVERS)
def test_checker_connections_killed_while_idle(kind: str, built_from: str, unique: str,
                                               admin: Any, quiet: None) -> None:
    """17 waves of 25 messages through ``@idempotent`` on a Redis checker; after each
    wave but the last is acked (every checker connection idle) they are all killed with
    CLIENT KILL (16 kills). Each next wave must go through at once: a dead idle connection is never
    written to (no hang until a timeout, no wait for none at all)."""
    from msgpatterns.idempotency import AsyncRedisChecker, RedisChecker

    waves, per_wave = 17, 25
    name = f"faults-checker-{unique}"
    url = with_client_name(services.require("redis"), name)
    driver = Driver(kind)
    if built_from == "url":
        target: Any = url
    else:  # a client without socket_timeout: a command on a dead connection never ends
        target = (redis.asyncio.Redis if driver.is_async else redis.Redis).from_url(url)
    checker = (AsyncRedisChecker if driver.is_async else RedisChecker)(
        target, namespace=f"faults-{unique}", ttl=600)
    sync_broker = InMemoryBroker()
    effects = Effects()
    topic = f"kill-idle-{unique}"

    if driver.is_async:
        @idempotent(checker, group="g")
        async def handle(message: Message) -> None:
            effects.applied(str(message.key))

        def build() -> Any:
            return AsyncConsumer(AsyncInMemoryBroker(sync_broker), handle, topics=[topic],
                                 group="g", max_in_flight=8, retry=POLICY, ack_timeout=0,
                                 poll_timeout=0.05)
    else:
        @idempotent(checker, group="g")
        def handle(message: Message) -> None:
            effects.applied(str(message.key))

        def build() -> Any:
            return Consumer(sync_broker, handle, topics=[topic], group="g", workers=8,
                            retry=POLICY, ack_timeout=0, poll_timeout=0.05)

    driver.start(build)
    kills = 0
    began = time.monotonic()
    try:
        for wave in range(waves):
            for i in range(per_wave):
                key = f"k{wave * per_wave + i}"
                sync_broker.publish(topic, {"n": key}, key=key)
            target_count = (wave + 1) * per_wave
            done = effects.wait_for(lambda n=target_count: len(sync_broker.acked) >= n, 60)
            assert done, (f"{kind}/{built_from}: wave {wave} stuck after {kills} kills: "
                          f"{len(sync_broker.acked)} of {target_count} done")
            if wave < waves - 1:
                killed = kill_named(admin, name)
                assert killed >= 1, "the checker's connections were not found by name"
                kills += 1
        seconds = time.monotonic() - began
    finally:
        driver.stop()
        driver.finish()
        if driver.is_async:
            asyncio.run(checker.aclose())
            if built_from == "client":
                asyncio.run(target.aclose())
        else:
            checker.close()
    total = waves * per_wave
    lost = sum(1 for i in range(total) if effects.count[f"k{i}"] == 0)
    report(f"redis CLIENT KILL idle checker ({kind}, {built_from})", total, kills, lost,
           effects.doubled(), sync_broker.pending, seconds)
    assert lost == 0
    assert effects.doubled() == 0
    assert kills == waves - 1
    # 425 messages take about 1.5 s without kills; a dead connection that is written to
    # costs a socket_timeout (5 s on a URL-built checker) or hangs for good.
    assert seconds < 60, f"{seconds:.1f}s for {total} messages"
