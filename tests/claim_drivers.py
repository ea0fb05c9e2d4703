"""``Consumer`` and ``AsyncConsumer`` behind one face, so that a claim-round scenario is
written once and runs on both drivers.

A test writes its handler's *body* once, as a generator over the message: it does its
work (records effects, raises) and ``yield``s the waits it needs - :class:`Sleep` (the
handler takes that long) or :class:`Until` (it waits for a condition). The sync driver
blocks on them in the worker thread; the async driver awaits them on its loop (a loop
thread of its own, so that the test body stays a plain function calling ``start()``,
``stop(timeout)`` and ``run_until_idle()`` on either driver).

The handler is ``@idempotent`` on the checker the driver built for a store: a
:class:`~msgpatterns.idempotency.MemoryChecker` for both, or a real Redis
(:class:`~msgpatterns.idempotency.RedisChecker` / ``AsyncRedisChecker``, a namespace of
its own, deleted afterwards). ``per_message=True`` wraps the decorated handler in a
plain function: the runtime then sees no ``@idempotent`` handler and every message
claims and completes its own key (the plain twin of batch claims - how
``docs/idempotency.md`` says to opt out of them).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from msgpatterns import Consumer, InMemoryBroker, Message
from msgpatterns.aio import AsyncConsumer, AsyncInMemoryBroker
from msgpatterns.idempotency import AsyncRedisChecker, MemoryChecker, RedisChecker, idempotent
from msgpatterns.testing import services

T = TypeVar("T")

GROUP = "claims.handle"
#: The stores a scenario runs on (Redis is the real server, with its marker).
STORES = ["memory", pytest.param("redis", marks=pytest.mark.redis)]


@dataclass(frozen=True)
class Sleep:
    """The handler takes ``seconds`` here."""

    seconds: float


@dataclass(frozen=True)
class Until:
    """The handler waits here until ``predicate()`` holds (or ``timeout`` passed: the
    test's own assertions then tell what went wrong)."""

    predicate: Callable[[], bool]
    timeout: float = 30.0


Step = Sleep | Until
#: A handler body: a generator over the message that yields its waits (or a plain
#: function without waits).
Body = Callable[[Message], "Iterator[Step] | None"]


def _steps(result: Iterator[Step] | None) -> Iterator[Step]:
    return result if inspect.isgenerator(result) else iter(())


def _block(step: Step) -> None:
    if isinstance(step, Sleep):
        time.sleep(step.seconds)
        return
    give_up = time.monotonic() + step.timeout
    while not step.predicate() and time.monotonic() < give_up:
        time.sleep(0.002)


async def _await(step: Step) -> None:
    if isinstance(step, Sleep):
        await asyncio.sleep(step.seconds)
        return
    give_up = time.monotonic() + step.timeout
    while not step.predicate() and time.monotonic() < give_up:
        await asyncio.sleep(0.002)


class Running:
    """A consumer under test, driven from the test's thread."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self, timeout: float | None = None) -> bool:
        raise NotImplementedError

    def run_until_idle(self, timeout: float = 60.0) -> None:
        raise NotImplementedError


class SyncRunning(Running):
    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer

    def start(self) -> None:
        self.consumer.start()

    def stop(self, timeout: float | None = None) -> bool:
        return self.consumer.stop(timeout)

    def run_until_idle(self, timeout: float = 60.0) -> None:
        self.consumer.run_until_idle(timeout)


class Loop:
    """An event loop on a thread of its own; coroutines are run there and waited for."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-loop",
                                        daemon=True)
        self._thread.start()

    def call(self, work: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class AsyncRunning(Running):
    def __init__(self, loop: Loop, consumer: AsyncConsumer) -> None:
        self.loop = loop
        self.consumer = consumer

    def start(self) -> None:
        self.loop.call(self.consumer.start())

    def stop(self, timeout: float | None = None) -> bool:
        return self.loop.call(self.consumer.stop(timeout))

    def run_until_idle(self, timeout: float = 60.0) -> None:
        self.loop.call(self.consumer.run_until_idle(timeout), timeout + 30)


class Driver:
    """How a scenario builds its checker and its consumer on one driver."""

    name = ""

    def __repr__(self) -> str:
        return self.name

    @contextmanager
    def checker(self, store: str, **options: Any) -> Iterator[Any]:
        raise NotImplementedError
        yield

    def consumer(self, broker: InMemoryBroker, body: Body, checker: Any, *,
                 workers: int = 4, per_message: bool = False,
                 **options: Any) -> Running:
        """A consumer of topic ``orders`` (group ``billing``) whose ``@idempotent``
        handler runs ``body``; ``workers`` are the sync driver's threads (the async
        driver runs up to ``max_in_flight`` at once)."""
        raise NotImplementedError


def _redis_cleanup(namespace: str) -> None:
    import redis

    client = redis.Redis.from_url(services.require("redis"))
    try:
        keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


class SyncDriver(Driver):
    name = "sync"

    @contextmanager
    def checker(self, store: str, **options: Any) -> Iterator[Any]:
        if store == "memory":
            yield MemoryChecker(**options)
            return
        namespace = f"test-claims-{uuid.uuid4().hex[:10]}"
        checker = RedisChecker(services.require("redis"), namespace, **options)
        try:
            yield checker
        finally:
            checker.close()
            _redis_cleanup(namespace)

    def consumer(self, broker: InMemoryBroker, body: Body, checker: Any, *,
                 workers: int = 4, per_message: bool = False,
                 **options: Any) -> Running:
        @idempotent(checker, group=GROUP)
        def handle(message: Message) -> None:
            for step in _steps(body(message)):
                _block(step)

        def plain(message: Message) -> None:
            handle(message)

        return SyncRunning(Consumer(broker, plain if per_message else handle,
                                    topics=["orders"], group="billing", workers=workers,
                                    **options))


class AsyncDriver(Driver):
    name = "async"

    def __init__(self) -> None:
        self._loop: Loop | None = None

    @property
    def loop(self) -> Loop:
        if self._loop is None:
            self._loop = Loop()
        return self._loop

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    @contextmanager
    def checker(self, store: str, **options: Any) -> Iterator[Any]:
        if store == "memory":
            yield MemoryChecker(**options)
            return
        namespace = f"test-claims-{uuid.uuid4().hex[:10]}"
        url = services.require("redis")

        async def make() -> AsyncRedisChecker:
            return AsyncRedisChecker(url, namespace=namespace, **options)

        checker = self.loop.call(make())
        try:
            yield checker
        finally:
            self.loop.call(checker.aclose())
            _redis_cleanup(namespace)

    def consumer(self, broker: InMemoryBroker, body: Body, checker: Any, *,
                 workers: int = 4, per_message: bool = False,
                 **options: Any) -> Running:
        @idempotent(checker, group=GROUP)
        async def handle(message: Message) -> None:
            for step in _steps(body(message)):
                await _await(step)

        async def plain(message: Message) -> None:
            await handle(message)

        async def make() -> AsyncConsumer:
            return AsyncConsumer(AsyncInMemoryBroker(broker),
                                 plain if per_message else handle,
                                 topics=["orders"], group="billing", **options)

        return AsyncRunning(self.loop, self.loop.call(make()))


@pytest.fixture(params=["sync", "async"])
def driver(request: pytest.FixtureRequest) -> Iterator[Driver]:
    """Each driver in turn (the async one with a loop thread of its own)."""
    if request.param == "sync":
        yield SyncDriver()
        return
    made = AsyncDriver()
    try:
        yield made
    finally:
        made.close()


def publish(broker: InMemoryBroker, count: int, prefix: str = "o") -> list[str]:
    """``count`` messages on ``orders``, each its own key (``{prefix}-{i}``, also its id)."""
    ids = [f"{prefix}-{i}" for i in range(count)]
    for message_id in ids:
        broker.publish("orders", {"id": message_id}, id=message_id)
    return ids
