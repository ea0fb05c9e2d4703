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
from redis_faults_proxy import LossyProxy

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


# -- hole 5: XREADGROUP replies lost on the wire -------------------------------------------


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
                   workers: int = 4, slow: float = 0.0) -> tuple[Callable[[], Any], list[Any]]:
    """``build`` for ``driver.start`` (a broker on ``url`` and a consumer of group "g"
    whose handler calls ``handle_sync``) and the list the broker lands in."""
    from msgpatterns.aio.redis_streams import AsyncRedisStreamsBroker
    from msgpatterns.brokers.redis_streams import RedisStreamsBroker

    brokers: list[Any] = []
    if driver.is_async:
        async def handle_async(message: Message) -> None:
            if slow:
                await asyncio.sleep(slow)
            handle_sync(message)

        def build() -> Any:
            broker = AsyncRedisStreamsBroker(url, consumer=consumer)
            brokers.append(broker)
            return AsyncConsumer(broker, handle_async, topics=[topic], group="g",
                                 max_in_flight=workers * 8, retry=POLICY, poll_timeout=0.05)
        return build, brokers

    def handle(message: Message) -> None:
        if slow:
            time.sleep(slow)
        handle_sync(message)

    def build_sync() -> Any:
        broker = RedisStreamsBroker(url, consumer=consumer, read_ahead=read_ahead)
        brokers.append(broker)
        return Consumer(broker, handle, topics=[topic], group="g", workers=workers,
                        retry=POLICY, poll_timeout=0.05)
    return build_sync, brokers


def close_broker(driver: Driver, broker: Any) -> None:
    driver.call(broker.close)


@pytest.mark.parametrize(("kind", "read_ahead"), [("sync", True), ("sync", False),
                                                  ("async", False)])
def test_lost_xreadgroup_replies_strand_nothing(kind: str, read_ahead: bool, unique: str,
                                                admin: Any, quiet: None) -> None:
    """400 entries from a foreign producer, read through a proxy that loses the reply
    of every third XREADGROUP (8 times): the server has delivered those entries to the
    consumer, which never sees them. Every entry must still be handled, and nothing
    stay pending once the input is drained - without waiting for the visibility
    timeout (30 minutes here)."""
    n = 400
    topic = f"lost-reply-{unique}"
    for i in range(n):
        admin.xadd(topic, {"body": f"m{i}"})
    effects = Effects()
    driver = Driver(kind)
    host, port, db = redis_address()
    with LossyProxy(host, port, doom=lambda data: b"XREADGROUP" in data, every=3,
                    most=8) as proxy:
        build, brokers = build_consumer(
            driver, proxy.url(db), topic,
            lambda message: effects.applied(message.raw_body.decode()),
            read_ahead=read_ahead)
        began = time.monotonic()
        driver.start(build)
        try:
            effects.wait_for(lambda: len(effects.count) >= n, 60)
            drained = effects.wait_for(lambda: pending_of(admin, topic, "g") == 0, 20)
            seconds = time.monotonic() - began
            stranded = pending_of(admin, topic, "g")
        finally:
            driver.stop()
            close_broker(driver, brokers[0])
            driver.finish()
        faults = proxy.lost
    drop_streams(admin, topic, "g")
    lost = sum(1 for i in range(n) if effects.count[f"m{i}"] == 0)
    mode = f"{kind}, read-ahead {'on' if read_ahead else 'off'}"
    report(f"redis lost XREADGROUP reply ({mode})", n, faults, lost, effects.doubled(),
           stranded, seconds)
    assert faults >= 1
    assert lost == 0, f"{lost} entries never handled (stranded under the live consumer)"
    assert stranded == 0 and drained
    assert effects.doubled() == 0  # lost replies are read again, not redelivered


# -- hole 6: stop() and close() from two threads -------------------------------------------


@pytest.mark.parametrize("kind", DRIVERS)
def test_stop_and_close_raced_strand_nothing(kind: str, unique: str, admin: Any,
                                             quiet: None) -> None:
    """12 rounds: a consumer with a backlog is running handlers when its ``stop()`` and
    its broker's ``close()`` are called from two threads (two tasks on the asyncio
    side) at the same moment, in alternating order. Nothing may stay pending under the
    closed consumer's name; a last consumer then drains the stream: every message
    handled, nothing pending."""
    import random

    rounds, per_round = 12, 150
    topic = f"race-{unique}"
    effects = Effects()
    rng = random.Random(unique)
    stranded = 0
    url = services.require("redis")
    began = time.monotonic()
    for r in range(rounds):
        for i in range(per_round):
            admin.xadd(topic, {"body": f"m{r * per_round + i}"})
        name = f"race-{unique}-{r}"
        driver = Driver(kind)
        build, brokers = build_consumer(
            driver, url, topic, lambda message: effects.applied(message.raw_body.decode()),
            consumer=name, slow=0.002)
        before = sum(effects.count.values())
        driver.start(build)
        effects.wait_for(lambda b=before: sum(effects.count.values()) >= b + 20, 30)
        broker = brokers[0]
        stop_first = r % 2 == 0
        delay = rng.uniform(0, 0.003)
        if driver.is_async:
            async def race(b: Any = broker, d: Driver = driver, first: bool = stop_first,
                           pause: float = delay) -> None:
                async def later(coro: Any) -> None:
                    await asyncio.sleep(pause)
                    await coro

                stop, close = d.consumer.stop(5), b.close()
                await asyncio.gather(*((stop, later(close)) if first else (close, later(stop))),
                                     return_exceptions=True)
            driver.call(race)
        else:
            barrier = threading.Barrier(2)

            def run(fn: Callable[[], Any], pause: float,
                    barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                time.sleep(pause)  # which call comes first: the race itself
                with contextlib.suppress(Exception):
                    fn()

            calls = [(lambda d=driver: d.consumer.stop(5), 0.0 if stop_first else delay),
                     (broker.close, delay if stop_first else 0.0)]
            threads = [threading.Thread(target=run, args=call) for call in calls]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
        driver.finish()
        stranded += pending_of(admin, topic, "g", consumer=name)
    total = rounds * per_round
    # the last consumer drains what the raced ones handed back (or left)
    driver = Driver(kind)
    build, brokers = build_consumer(
        driver, url, topic, lambda message: effects.applied(message.raw_body.decode()))
    driver.start(build)
    try:
        effects.wait_for(lambda: len(effects.count) >= total, 60)
        effects.wait_for(lambda: pending_of(admin, topic, "g") == 0, 20)
        seconds = time.monotonic() - began
        left = pending_of(admin, topic, "g")
    finally:
        driver.stop()
        close_broker(driver, brokers[0])
        driver.finish()
    drop_streams(admin, topic, "g")
    lost = sum(1 for i in range(total) if effects.count[f"m{i}"] == 0)
    report(f"redis stop()/close() raced ({kind})", total, rounds, lost, effects.doubled(),
           stranded + left, seconds)
    assert stranded == 0, f"{stranded} deliveries pending under closed consumers"
    assert lost == 0 and left == 0
