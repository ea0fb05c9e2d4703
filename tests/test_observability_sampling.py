"""Telemetry that costs little (issue 24): counters stay exact whatever the duration
sample rate, the duration histograms hold the sampled share, and the consumer's plain
ack hot path - which a listener no longer turns off - reports exactly what the full
settlement reported."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from msgpatterns import Consumer, InMemoryBroker, Message, Reject
from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency import MemoryChecker, idempotent
from msgpatterns.observability import OpenTelemetry, instrument, uninstrument
from two_drivers import Otel


@pytest.fixture
def metrics() -> Iterator[Otel]:
    yield Otel()
    uninstrument()


def _run(n: int, poison_every: int = 0) -> Consumer:
    broker = InMemoryBroker()
    for i in range(n):
        broker.publish("orders", "poison" if poison_every and i % poison_every == 0 else "ok",
                       key=f"k{i}")

    def handle(message: Message) -> None:
        if message.body == "poison":
            raise Reject("bad")

    consumer = Consumer(broker, handle, topics=["orders"], group="g")
    consumer.run_until_idle(timeout=60)
    return consumer


def _deliveries(metrics: Otel, outcome: str) -> int:
    return metrics.total("msgpatterns.consumer.deliveries", **{"msgpatterns.outcome": outcome})


def test_the_default_samples_durations_and_keeps_every_counter_exact(metrics: Otel) -> None:
    random.seed(24)
    instrument(meter_provider=metrics.meter_provider, tracing=False)
    n = 3000
    stats = _run(n, poison_every=10).stats
    assert (stats.acked, stats.dead_lettered) == (2700, 300)
    assert _deliveries(metrics, "acked") == stats.acked
    assert _deliveries(metrics, "dead_lettered") == stats.dead_lettered
    assert metrics.total("msgpatterns.consumer.fetched") == stats.fetched == n
    assert metrics.total("msgpatterns.consumer.failed") == stats.failed == 300
    # A uniform sample at 0.1: 300 expected, sd about 16; the bounds are 6 sd wide.
    sampled = metrics.count("messaging.process.duration")
    assert 200 <= sampled <= 400, sampled
    failed = sum(p.count for p in metrics.points("messaging.process.duration")
                 if "error.type" in p.attributes)
    assert 0 < failed < sampled


@pytest.mark.parametrize("rate", [0.0, 1.0])
def test_rate_zero_records_no_duration_and_one_records_every_one(
        metrics: Otel, rate: float) -> None:
    instrument(meter_provider=metrics.meter_provider, tracing=False, duration_sample_rate=rate)
    checker = MemoryChecker(namespace="sampling")

    @idempotent(checker, key=lambda message: message.key)
    def inner(message: Message) -> None:
        pass

    broker = InMemoryBroker()
    for i in range(50):
        broker.publish("orders", "ok", key=f"k{i}")
    stats = Consumer(broker, inner, topics=["orders"], group="g").run_until_idle(timeout=30)
    assert _deliveries(metrics, "acked") == stats.acked == 50
    trips = metrics.total("msgpatterns.idempotency.store.round_trips")
    assert trips > 0
    expected = 0 if rate == 0.0 else 50
    assert metrics.count("messaging.process.duration") == expected
    assert metrics.count("msgpatterns.idempotency.store.duration") == \
        (0 if rate == 0.0 else trips)


@pytest.mark.parametrize("rate", [-0.1, 1.5, math.nan, math.inf])
def test_a_rate_outside_zero_to_one_is_refused(rate: float) -> None:
    with pytest.raises(ConfigurationError, match="duration_sample_rate"):
        OpenTelemetry(duration_sample_rate=rate)


def test_spans_of_sampled_out_durations_are_still_complete(metrics: Otel) -> None:
    """Tracing is not sampled by the duration rate: every delivery has its span, with
    its outcome, whatever share of durations is recorded."""
    spans = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    instrument(meter_provider=metrics.meter_provider, tracer_provider=tracer_provider,
               duration_sample_rate=0.0)
    stats = _run(40, poison_every=4).stats
    finished = spans.get_finished_spans()
    outcomes = sorted(s.attributes["messaging.msgpatterns.outcome"] for s in finished)
    assert outcomes == ["acked"] * stats.acked + ["dead_lettered"] * stats.dead_lettered
    assert metrics.count("messaging.process.duration") == 0


class _FlakyAcks(InMemoryBroker):
    """Every third ack fails (the broker connection dropped, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.acks = 0

    def ack(self, message: Message) -> None:
        self.acks += 1
        if self.acks % 3 == 0:
            raise ConnectionError("ack lost")
        super().ack(message)


@pytest.mark.parametrize("listening", [False, True])
def test_failed_acks_on_the_hot_path_are_settled_and_reported_like_any_other(
        metrics: Otel, listening: bool) -> None:
    """Differential: the same run with and without a listener settles alike, and the
    listener's counts equal the consumer's own, failed acks included."""
    if listening:
        instrument(meter_provider=metrics.meter_provider, tracing=False)
    broker = _FlakyAcks()
    for i in range(30):
        broker.publish("orders", "ok", key=f"k{i}")
    consumer = Consumer(broker, lambda message: None, topics=["orders"], group="g")
    stats = consumer.run_until_idle(timeout=60)
    assert stats.broker_errors > 0 and consumer.in_flight == 0
    assert stats.acked + stats.redelivered + stats.dead_lettered >= 30
    if listening:
        for name, value in stats.as_dict().items():
            if name in ("acked", "redelivered", "dead_lettered", "released",
                        "retried_locally"):
                continue
            assert metrics.total(f"msgpatterns.consumer.{name}") == value, name
        assert _deliveries(metrics, "acked") == stats.acked
        assert _deliveries(metrics, "retried_later") == stats.redelivered


class _AsyncFlakyAcks:
    """An AsyncInMemoryBroker whose every third ack fails."""

    def __new__(cls) -> Any:
        from msgpatterns.aio import AsyncInMemoryBroker

        class Flaky(AsyncInMemoryBroker):
            acks = 0

            async def ack(self, message: Message) -> None:
                self.acks += 1
                if self.acks % 3 == 0:
                    raise ConnectionError("ack lost")
                await super().ack(message)

        return Flaky(seed=0)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_async_consumers_hot_path_reports_what_it_settled(
        metrics: Otel, anyio_backend: str) -> None:
    """AsyncConsumer: plain acks settled on its hot path are reported one by one, and
    failed acks too, so the listener's counts equal the consumer's own."""
    from msgpatterns.aio import AsyncConsumer

    instrument(meter_provider=metrics.meter_provider, tracing=False)
    broker = _AsyncFlakyAcks()
    for i in range(30):
        await broker.publish("orders", b"ok", key=f"k{i}")

    async def handle(message: Message) -> None:
        return None

    stats = await AsyncConsumer(broker, handle, topics=["orders"],
                                group="g").run_until_idle(timeout=30)
    assert stats.broker_errors > 0 and stats.acked > 0
    assert _deliveries(metrics, "acked") == stats.acked
    assert _deliveries(metrics, "retried_later") == stats.redelivered
    # (the async consumer reports its settlements; its fetch counts are not reported
    # yet, a gap of the async driver left for the driver parity work)
    for name in ("failed", "broker_errors"):
        assert metrics.total(f"msgpatterns.consumer.{name}") == getattr(stats, name), name
