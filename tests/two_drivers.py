"""``Consumer`` and ``AsyncConsumer`` behind one face: a test is written once and runs
on both drivers - the parity suite (``tests/parity/``, its ``driver`` fixture), the
claim-round scenarios (``tests/claim_drivers.py``) - and the in-memory OpenTelemetry
SDK those and ``tests/test_observability.py`` assert on (:class:`Otel`).

A test writes its handler's *body* once, as a plain function of the message (or of
the list of messages, for ``batch=True``). It does its work - records effects, raises,
disables auto ack - and, where it must wait, returns a generator that ``yield``\\ s
the waits: :class:`Sleep` (the handler takes that long) or :class:`Until` (it waits for
a condition). The sync driver blocks on them in its worker thread; the async driver
awaits them on its event loop - a loop thread of the test's own, so the test body
stays a plain function that calls ``start()``, ``stop(timeout)``, ``health()`` and
``run_until_idle()`` on either driver, from the test's thread (for the async driver
that is a foreign thread, as ``HealthServer``'s is).

Brokers: a test hands its consumer an :class:`~msgpatterns.InMemoryBroker` (the async
driver wraps it in an :class:`~msgpatterns.aio.AsyncInMemoryBroker`: one fake, one
state, asserted on the same way), or a real Redis Streams or NATS JetStream adapter
made by :meth:`Driver.redis_broker` or :meth:`Driver.nats_broker` (the sync or the
asyncio adapter, same wire format).
"""

from __future__ import annotations

import asyncio
import inspect
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from msgpatterns import Consumer, InMemoryBroker, Message
from msgpatterns.aio import AsyncConsumer, AsyncInMemoryBroker
from msgpatterns.consumer import ConsumerStats
from msgpatterns.idempotency import idempotent
from msgpatterns.observability import Health
from msgpatterns.testing import services
from msgpatterns.testing.checker_fixtures import checker_for

T = TypeVar("T")

#: The section of docs/asyncio.md that lists every difference between the drivers; a
#: parity test that one driver fails on purpose is an ``xfail`` naming it.
DIFFERENCES = "docs/asyncio.md, section 'Differences from Consumer'"


@dataclass(frozen=True)
class Sleep:
    """The handler takes ``seconds`` here."""

    seconds: float


@dataclass(frozen=True)
class Until:
    """The handler waits here until ``predicate()`` holds (at most ``timeout`` seconds:
    the test's own assertions then tell what went wrong)."""

    predicate: Callable[[], bool]
    timeout: float = 30.0


@dataclass(frozen=True)
class Do:
    """The handler calls ``fn()`` here - awaiting what it returns on the async driver
    (``consumer.stop()`` is a coroutine there) - and appends the result to ``into``."""

    fn: Callable[[], Any]
    into: list[Any]


Step = Sleep | Until | Do
#: A handler body: a function of the message (or the list) returning None or a
#: generator of the waits it needs.
Body = Callable[[Any], "Iterator[Step] | None"]


def steps_of(result: Any) -> Iterator[Step]:
    return result if inspect.isgenerator(result) else iter(())


def block(step: Step) -> None:
    if isinstance(step, Do):
        step.into.append(step.fn())
        return
    if isinstance(step, Sleep):
        time.sleep(step.seconds)
        return
    give_up = time.monotonic() + step.timeout
    while not step.predicate() and time.monotonic() < give_up:
        time.sleep(0.002)


async def wait(step: Step) -> None:
    if isinstance(step, Do):
        result = step.fn()
        step.into.append(await result if inspect.isawaitable(result) else result)
        return
    if isinstance(step, Sleep):
        await asyncio.sleep(step.seconds)
        return
    give_up = time.monotonic() + step.timeout
    while not step.predicate() and time.monotonic() < give_up:
        await asyncio.sleep(0.002)


def eventually(predicate: Callable[[], Any], timeout: float = 30.0) -> None:
    """Wait (in the test's thread) until ``predicate()`` is true; fail after ``timeout``."""
    give_up = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > give_up:
            raise AssertionError(f"not true within {timeout}s: {predicate}")
        time.sleep(0.005)


class Loop:
    """An event loop on a thread of its own; coroutines are run there and waited for."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="parity-loop",
                                        daemon=True)
        self._thread.start()

    def call(self, work: Coroutine[Any, Any, T], timeout: float = 120.0) -> T:
        return asyncio.run_coroutine_threadsafe(work, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class Running:
    """A consumer under test, driven from the test's thread."""

    consumer: Any

    def start(self) -> None:
        raise NotImplementedError

    def stop(self, timeout: float | None = None) -> bool:
        raise NotImplementedError

    def run_until_idle(self, timeout: float = 60.0) -> ConsumerStats:
        raise NotImplementedError

    def run(self) -> None:
        """``run()`` until a stop (from a handler) ends it."""
        raise NotImplementedError

    @property
    def stats(self) -> ConsumerStats:
        return self.consumer.stats  # type: ignore[no-any-return]

    @property
    def in_flight(self) -> int:
        return self.consumer.in_flight  # type: ignore[no-any-return]

    def health(self) -> Health:
        """``consumer.health()`` from the test's thread."""
        return self.consumer.health()  # type: ignore[no-any-return]

    def consume(self, settled: int, timeout: float = 60.0,
                stop_timeout: float | None = 30.0) -> ConsumerStats:
        """Start, wait until ``settled`` messages were acked or dead-lettered, stop."""
        self.start()
        try:
            eventually(lambda: self.stats.acked + self.stats.dead_lettered >= settled,
                       timeout)
        finally:
            self.stop(stop_timeout)
        return self.stats


class SyncRunning(Running):
    def __init__(self, consumer: Consumer) -> None:
        self.consumer = consumer

    def start(self) -> None:
        self.consumer.start()

    def stop(self, timeout: float | None = None) -> bool:
        return self.consumer.stop(timeout)

    def run_until_idle(self, timeout: float = 60.0) -> ConsumerStats:
        return self.consumer.run_until_idle(timeout)

    def run(self) -> None:
        self.consumer.run()


class AsyncRunning(Running):
    def __init__(self, loop: Loop, consumer: AsyncConsumer) -> None:
        self.loop = loop
        self.consumer = consumer

    def start(self) -> None:
        self.loop.call(self.consumer.start())

    def stop(self, timeout: float | None = None) -> bool:
        return self.loop.call(self.consumer.stop(timeout))

    def run_until_idle(self, timeout: float = 60.0) -> ConsumerStats:
        return self.loop.call(self.consumer.run_until_idle(timeout), timeout + 30)

    def run(self) -> None:
        self.loop.call(self.consumer.run())


class Driver:
    """How a test builds its handler, its broker and its consumer on one driver."""

    name = ""
    is_async = False

    def __repr__(self) -> str:
        return self.name

    def handler(self, body: Body) -> Callable[[Any], Any]:
        """The driver's kind of handler (plain or ``async def``) running ``body``; the
        same for a batch handler (``body`` then gets the list)."""
        raise NotImplementedError

    def idempotent(self, checker: Any, body: Body, **options: Any) -> Callable[[Any], Any]:
        """:meth:`handler` decorated with ``@idempotent(checker, **options)``."""
        return idempotent(checker, **options)(self.handler(body))

    def wrong_handler(self) -> Callable[[Any], Any]:
        """A handler of the other driver's kind (the wrong kind here)."""
        raise NotImplementedError

    def plain(self, handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``handler`` called from a plain function of the driver's kind: the runtime
        sees no ``@idempotent`` handler (no batch claims: each message claims and
        completes its own key)."""
        raise NotImplementedError

    def consumer(self, broker: Any, handler: Callable[[Any], Any], *, topics: Any = "t",
                 group: str = "g", workers: int = 4, **options: Any) -> Running:
        """A consumer of ``topics`` in ``group``. ``broker``: an InMemoryBroker (the
        async driver wraps it) or an adapter of this driver. ``workers``: the sync
        driver's threads (the async driver runs up to ``max_in_flight`` at once)."""
        raise NotImplementedError

    def make(self, cls: Callable[..., Any], *args: Any, **options: Any) -> Any:
        """``cls(*args, **options)``, built on the driver's loop for the async driver
        (asyncio clients bind to the loop that makes them)."""
        return cls(*args, **options)

    def close(self, resource: Any) -> None:
        """Close what :meth:`make` built (``aclose``/``close`` awaited on the loop)."""
        resource.close()

    def build(self, make_consumer: Callable[[], T]) -> T:
        """``make_consumer()`` where this driver's consumers are built (to check what
        the constructor refuses)."""
        return make_consumer()

    @contextmanager
    def checker(self, store: str, tmp_path: Path | None = None,
                **options: Any) -> Iterator[Any]:
        """The checker this driver's ``@idempotent`` handlers use on ``store``: the
        stores of :func:`~msgpatterns.testing.checker_fixtures.checker_for` for the sync
        driver (``tmp_path``: where a SQLite one goes); for the async driver a
        MemoryChecker (it serves both), or an AsyncRedisChecker on the real Redis (a
        namespace of its own, deleted after)."""
        if not self.is_async or store == "memory":
            where = Path(tempfile.gettempdir()) if tmp_path is None else tmp_path
            with checker_for(store, where, **options) as checker:
                yield checker
            return
        assert store == "redis", store
        from msgpatterns.idempotency import AsyncRedisChecker

        namespace = f"parity-{uuid.uuid4().hex[:10]}"
        url = services.require("redis")
        checker = self.make(AsyncRedisChecker, url, namespace=namespace, **options)
        try:
            yield checker
        finally:
            self.close(checker)
            import redis

            client = redis.Redis.from_url(url)
            try:
                keys = list(client.scan_iter(match=f"{namespace}:*", count=1000))
                if keys:
                    client.delete(*keys)
            finally:
                client.close()

    @contextmanager
    def redis_broker(self, url: str, **options: Any) -> Iterator[Any]:
        """This driver's Redis Streams adapter on ``url`` (closed afterwards)."""
        if self.is_async:
            from msgpatterns.aio import AsyncRedisStreamsBroker as cls
        else:
            from msgpatterns.brokers import RedisStreamsBroker as cls  # type: ignore[assignment]
        broker = self.make(cls, url, **options)
        try:
            yield broker
        finally:
            self.close(broker)

    @contextmanager
    def nats_broker(self, url: str, **options: Any) -> Iterator[Any]:
        """This driver's NATS JetStream adapter on ``url`` (closed afterwards): the
        sync one, or the native asyncio one."""
        if self.is_async:
            from msgpatterns.aio import AsyncNatsJetStreamBroker as cls
        else:
            from msgpatterns.brokers import NatsJetStreamBroker as cls  # type: ignore[assignment]
        broker = self.make(cls, url, **options)
        try:
            yield broker
        finally:
            self.close(broker)

    def shutdown(self) -> None:
        """The test is over."""


class SyncDriver(Driver):
    name = "sync"

    def handler(self, body: Body) -> Callable[[Any], Any]:
        def handle(message: Any) -> None:
            for step in steps_of(body(message)):
                block(step)

        return handle

    def wrong_handler(self) -> Callable[[Any], Any]:
        async def handle(message: Message) -> None:
            return None

        return handle

    def plain(self, handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def handle(message: Any) -> None:
            handler(message)

        return handle

    def consumer(self, broker: Any, handler: Callable[[Any], Any], *, topics: Any = "t",
                 group: str = "g", workers: int = 4, **options: Any) -> Running:
        return SyncRunning(Consumer(broker, handler, topics=topics, group=group,
                                    workers=workers, **options))


class AsyncDriver(Driver):
    name = "async"
    is_async = True

    def __init__(self) -> None:
        self._loop: Loop | None = None

    @property
    def loop(self) -> Loop:
        if self._loop is None:
            self._loop = Loop()
        return self._loop

    def shutdown(self) -> None:
        if self._loop is not None:
            self._loop.close()
            self._loop = None

    def handler(self, body: Body) -> Callable[[Any], Any]:
        async def handle(message: Any) -> None:
            for step in steps_of(body(message)):
                await wait(step)

        return handle

    def wrong_handler(self) -> Callable[[Any], Any]:
        def handle(message: Message) -> None:
            return None

        return handle

    def plain(self, handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
        async def handle(message: Any) -> None:
            await handler(message)

        return handle

    def consumer(self, broker: Any, handler: Callable[[Any], Any], *, topics: Any = "t",
                 group: str = "g", workers: int = 4, **options: Any) -> Running:
        if isinstance(broker, InMemoryBroker):
            broker = AsyncInMemoryBroker(broker)

        async def make() -> AsyncConsumer:
            return AsyncConsumer(broker, handler, topics=topics, group=group, **options)

        return AsyncRunning(self.loop, self.loop.call(make()))

    def make(self, cls: Callable[..., Any], *args: Any, **options: Any) -> Any:
        async def made() -> Any:
            return cls(*args, **options)

        return self.loop.call(made())

    def close(self, resource: Any) -> None:
        closing = getattr(resource, "aclose", None) or resource.close
        self.loop.call(closing())

    def build(self, make_consumer: Callable[[], T]) -> T:
        async def made() -> T:
            return make_consumer()

        return self.loop.call(made())


def publish(broker: InMemoryBroker, count: int, prefix: str = "o") -> list[str]:
    """``count`` messages on ``orders``, each its own key (``{prefix}-{i}``, also its id)."""
    ids = [f"{prefix}-{i}" for i in range(count)]
    for message_id in ids:
        broker.publish("orders", {"id": message_id}, id=message_id)
    return ids


@contextmanager
def driver_named(name: str) -> Iterator[Driver]:
    made: Driver = SyncDriver() if name == "sync" else AsyncDriver()
    try:
        yield made
    finally:
        made.shutdown()


class Otel:
    """OpenTelemetry's SDK with in-memory exporters (:func:`installed_otel` installs it
    as the listener)."""

    def __init__(self) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )

        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])

    def finished(self) -> list[Any]:
        return list(self.spans.get_finished_spans())

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        found = []
        for rm in data.resource_metrics if data else []:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    if metric.name == name:
                        found.extend(metric.data.data_points)
        return found

    def total(self, name: str, **attrs: str) -> int:
        """The sum of the counter ``name``'s points whose attributes include ``attrs``."""
        return sum(int(p.value) for p in self.points(name)
                   if all(p.attributes.get(k) == v for k, v in attrs.items()))

    def count(self, name: str) -> int:
        """How many values the histogram ``name`` recorded."""
        return sum(p.count for p in self.points(name))


@contextmanager
def installed_otel() -> Iterator[Otel]:
    """An :class:`Otel` installed as the telemetry listener for the block (every
    duration recorded: a test counts the histogram against the deliveries); the
    ``otel`` fixtures. Skips the test without OpenTelemetry's SDK."""
    pytest.importorskip("opentelemetry.sdk")
    from msgpatterns.observability import instrument, uninstrument

    o = Otel()
    instrument(tracer_provider=o.tracer_provider, meter_provider=o.meter_provider,
               duration_sample_rate=1.0)
    try:
        yield o
    finally:
        uninstrument()
