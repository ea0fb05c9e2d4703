"""One lifecycle for both drivers, from the outside: ``with Consumer(...)`` /
``async with AsyncConsumer(...)`` start the consumer and close it; ``close()`` /
``aclose()`` is idempotent, a closed consumer never starts again (``ClosedError``), a
close raced from other threads while ``run()`` runs loses nothing, and what the
consumer was given (the broker, the checker) stays open.

Each scenario is written once and runs on the thread driver and on the asyncio driver
(its loop on a thread of its own, so the test body is the same plain function), on the
in-memory fake and on a real Redis Streams server.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from msgpatterns import Consumer, InMemoryBroker, Message
from msgpatterns.aio import AsyncConsumer, AsyncInMemoryBroker
from msgpatterns.errors import ClosedError
from msgpatterns.idempotency import MemoryChecker, idempotent
from msgpatterns.testing import services
from two_drivers import Loop

pytestmark = pytest.mark.timeout(120)

TOPIC, GROUP = "orders", "billing"


class Face:
    """One consumer on one driver, driven from the test's thread."""

    def __init__(self, consumer: Any, loop: Loop | None) -> None:
        self.consumer = consumer
        self.loop = loop

    def _call(self, work: Callable[[], Any]) -> Any:
        if self.loop is None:
            return work()
        return self.loop.call(work())

    def start(self) -> None:
        self._call(self.consumer.start)

    def close(self) -> None:
        self._call(self.consumer.close if self.loop is None else self.consumer.aclose)

    def run_until_idle(self) -> None:
        self._call(lambda: self.consumer.run_until_idle(60))

    def run_in_background(self) -> Future[None]:
        """``run()`` on a thread of its own (sync) or as a task on the loop (async)."""
        if self.loop is not None:
            return asyncio.run_coroutine_threadsafe(self.consumer.run(), self.loop.loop)
        done: Future[None] = Future()

        def run() -> None:
            try:
                self.consumer.run()
                done.set_result(None)
            except BaseException as exc:
                done.set_exception(exc)

        threading.Thread(target=run, name="test-run", daemon=True).start()
        return done

    def __enter__(self) -> Face:
        self._call(self.consumer.__enter__ if self.loop is None
                   else self.consumer.__aenter__)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.loop is None:
            self.consumer.__exit__(None, None, None)
        else:
            self.loop.call(self.consumer.__aexit__(None, None, None))


class Setup:
    """A driver ("sync" or "async") on a broker kind ("memory" or "redis"): makes
    consumers of one topic and group, publishes, and reads what is left pending."""

    def __init__(self, driver: str, kind: str) -> None:
        self.driver, self.kind = driver, kind
        self.loop = Loop() if driver == "async" else None
        self.topic = f"{TOPIC}-{uuid.uuid4().hex[:8]}"
        self._brokers: list[Any] = []
        if kind == "memory":
            self.fake = InMemoryBroker()
        else:
            import redis

            self.url = services.require("redis")
            self.client = redis.Redis.from_url(self.url)

    def broker(self) -> Any:
        """A broker of the driver's kind, the test's to close (never the consumer's)."""
        if self.kind == "memory":
            broker: Any = self.fake if self.loop is None else AsyncInMemoryBroker(self.fake)
        elif self.loop is None:
            from msgpatterns.brokers import RedisStreamsBroker

            broker = RedisStreamsBroker(self.url, visibility_timeout=2.0)
        else:
            from msgpatterns.aio.redis_streams import AsyncRedisStreamsBroker

            async def make() -> Any:
                return AsyncRedisStreamsBroker(self.url, visibility_timeout=2.0)

            broker = self.loop.call(make())
        self._brokers.append(broker)
        return broker

    def consumer(self, broker: Any, body: Callable[[Message], None], *, delay: float = 0.0,
                 **options: Any) -> Face:
        """A consumer whose handler runs ``body`` (a plain function, on either driver)
        after waiting ``delay`` seconds (a sleep on the thread driver, an awaited one
        on the asyncio driver)."""
        options = {"topics": [self.topic], "group": GROUP, "poll_timeout": 0.05, **options}
        if self.loop is None:
            options.pop("max_in_flight", None)

            def run(message: Message) -> None:
                if delay:
                    time.sleep(delay)
                body(message)

            return Face(Consumer(broker, run, workers=4, **options), None)

        async def handle(message: Message) -> None:
            if delay:
                await asyncio.sleep(delay)
            body(message)

        return Face(AsyncConsumer(broker, handle, **options), self.loop)

    def publish(self, count: int) -> list[str]:
        if self.kind == "memory":
            return [self.fake.publish(self.topic, f"m{i}".encode()) for i in range(count)]
        from msgpatterns.brokers import RedisStreamsBroker

        with RedisStreamsBroker(self.url) as publisher:
            return [publisher.publish(self.topic, f"m{i}".encode()) for i in range(count)]

    def pending(self) -> int:
        """Deliveries fetched under the group and neither acked nor handed back."""
        if self.kind == "memory":
            return self.fake.in_flight(GROUP) + self.fake.pending_for(GROUP, self.topic)
        return int(self.client.xpending(self.topic, GROUP)["pending"])

    def close(self) -> None:
        for broker in self._brokers:
            if self.kind == "memory":
                continue  # the shared fake
            if self.loop is not None:
                self.loop.call(broker.aclose())
            else:
                broker.close()
        if self.loop is not None:
            self.loop.close()
        if self.kind == "redis":
            t = self.topic
            self.client.delete(t, f"{t}:retry:{GROUP}", f"{t}:delayed:{GROUP}", f"{t}:dlq")
            self.client.close()


@pytest.fixture(params=[
    pytest.param(("sync", "memory"), id="sync-memory"),
    pytest.param(("async", "memory"), id="async-memory"),
    pytest.param(("sync", "redis"), id="sync-redis", marks=pytest.mark.redis),
    pytest.param(("async", "redis"), id="async-redis", marks=pytest.mark.redis),
])
def setup(request: pytest.FixtureRequest) -> Iterator[Setup]:
    built = Setup(*request.param)
    try:
        yield built
    finally:
        built.close()


def _wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    give_up = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.005)


def test_with_starts_and_closes_and_a_closed_consumer_never_starts_again(
        setup: Setup) -> None:
    seen: list[bytes] = []
    ids = setup.publish(5)
    broker = setup.broker()
    with setup.consumer(broker, lambda m: seen.append(m.raw_body)) as face:
        _wait_for(lambda: len(seen) == 5)
    consumer = face.consumer
    assert consumer.closed and consumer.in_flight == 0
    face.close()  # a second close does nothing
    face.close()
    for use in (face.start, face.run_until_idle):
        with pytest.raises(ClosedError, match="closed"):
            use()
    with pytest.raises(ClosedError):
        face.run_in_background().result(30)
    # The broker was the test's: still open, and nothing was consumed after the close.
    setup.publish(1)
    time.sleep(0.2)
    assert sorted(seen) == sorted(f"m{i}".encode() for i in range(5)) and len(ids) == 5
    assert not broker.closed


@pytest.mark.parametrize("checker_kind", ["memory"])
def test_close_leaves_what_the_consumer_was_given_open(setup: Setup,
                                                       checker_kind: str) -> None:
    """The consumer owns only what it started; the broker and the checker of its
    ``@idempotent`` handler are the caller's to close."""
    checker = MemoryChecker()
    handled: list[str | None] = []

    @idempotent(checker)
    def body(message: Message) -> None:
        handled.append(message.id)

    ids = setup.publish(3)
    broker = setup.broker()
    if setup.loop is None:
        face = setup.consumer(broker, body)
    else:
        @idempotent(checker)
        async def handle(message: Message) -> None:
            handled.append(message.id)

        face = Face(AsyncConsumer(broker, handle, topics=[setup.topic], group=GROUP,
                                  poll_timeout=0.05), setup.loop)
    with face:
        _wait_for(lambda: len(handled) == 3)
    assert sorted(handled) == sorted(ids)  # type: ignore[type-var]
    assert not checker.closed and not broker.closed
    assert checker.claim("another").status.name == "CLAIMED"  # still usable


def test_close_raced_from_other_threads_while_run_runs_loses_nothing(setup: Setup) -> None:
    """``run()`` consumes on its own thread (or loop task); two other threads close the
    consumer at once, mid-stream. ``run()`` returns, both closes return only when the
    consumer has stopped, no handler runs after that, and every message is either
    handled or handed back: a new consumer handles the rest, and nothing is left
    pending."""
    total = 300
    handled: list[bytes] = []
    lock = threading.Lock()

    def body(message: Message) -> None:
        with lock:
            handled.append(message.raw_body)

    setup.publish(total)
    broker = setup.broker()
    face = setup.consumer(broker, body, delay=0.005, max_in_flight=4)
    running = face.run_in_background()
    _wait_for(lambda: len(handled) >= 30)
    go = threading.Barrier(2)
    errors: list[BaseException] = []

    def close() -> None:
        go.wait()
        try:
            face.close()
        except BaseException as exc:
            errors.append(exc)

    closers = [threading.Thread(target=close) for _ in range(2)]
    for thread in closers:
        thread.start()
    for thread in closers:
        thread.join(60)
    assert errors == []
    running.result(60)  # run() returned, without an error
    after_close = len(handled)
    time.sleep(0.2)
    assert len(handled) == after_close  # no handler ran after the close returned
    assert face.consumer.closed and face.consumer.in_flight == 0
    assert after_close < total  # the close did interrupt the stream

    rest = setup.consumer(broker, body)
    rest.run_until_idle()
    assert sorted(set(handled)) == sorted(f"m{i}".encode() for i in range(total))
    assert setup.pending() == 0


def test_close_from_a_handler_requests_the_stop_and_run_returns(setup: Setup) -> None:
    seen: list[bytes] = []
    setup.publish(50)
    broker = setup.broker()
    face: Face | None = None
    closed = threading.Event()
    tasks: list[asyncio.Task[None]] = []

    def body(message: Message) -> None:
        seen.append(message.raw_body)
        if len(seen) == 5:
            assert face is not None
            if face.loop is None:
                face.consumer.close()  # requests the stop, returns at once
            else:  # from the handler's own task: aclose() requests the stop too
                tasks.append(asyncio.ensure_future(face.consumer.aclose()))
            closed.set()

    face = setup.consumer(broker, body, max_in_flight=4)
    face.run_in_background().result(60)
    assert closed.is_set() and face.consumer.closed
    with pytest.raises(ClosedError):
        face.start()


def test_a_consumer_closed_before_it_started_never_starts(setup: Setup) -> None:
    face = setup.consumer(setup.broker(), lambda m: None)
    face.close()
    face.close()
    assert face.consumer.closed
    with pytest.raises(ClosedError):
        face.start()
    with pytest.raises(ClosedError):
        face.__enter__()
