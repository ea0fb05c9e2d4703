"""Observability (issue 14): trace context travels through headers, Prometheus is
scraped over HTTP, structured log fields, counts stay exact per consumer, and nothing
is paid while it is off. (A consumer's spans, metrics and health over HTTP are checked
on both drivers by tests/parity/test_parity_telemetry.py.)"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.trace import SpanKind

from msgpatterns import (
    Backoff,
    Consumer,
    InMemoryBroker,
    Message,
    Reject,
    RetryPolicy,
)
from msgpatterns.batching import BatchExecutor
from msgpatterns.brokers import codec
from msgpatterns.deadletter import DeadLetter
from msgpatterns.observability import (
    get_listener,
    serve_prometheus,
)
from two_drivers import Otel, installed_otel


@pytest.fixture
def otel() -> Iterator[Otel]:
    with installed_otel() as o:  # every duration recorded: histogram counts are exact
        yield o


def test_wire_headers_carry_trace_context_on_publish_retry_and_dead_letter(otel: Otel) -> None:
    tracer = otel.tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("send") as span:
        published = codec.wire_headers({"a": "1"}, message_id="m1")
    assert published["traceparent"].split("-")[2] == format(span.get_span_context().span_id,
                                                               "016x")
    # a message without a publisher's context: its retry and dead letter carry the
    # context of the delivery that failed, so the next attempt joins that trace
    broker = InMemoryBroker()
    broker.publish("t", "x")
    captured: dict[str, dict[str, str]] = {}

    def handle(message: Message) -> None:
        captured["retry"] = codec.redelivery_headers(message)
        captured["dead"] = codec.dead_letter_headers(DeadLetter.from_error(
            message, ValueError("x"), now=0.0, reason="test", group="g"))
        captured["kept"] = codec.redelivery_headers(
            Message("y", headers={"traceparent": published["traceparent"]}))

    Consumer(broker, handle, topics=["t"], group="g").run_until_idle(timeout=10)
    (delivery,) = [s for s in otel.finished() if s.name == "process t"]
    own = format(delivery.context.span_id, "016x")
    assert captured["retry"]["traceparent"].split("-")[2] == own
    assert captured["dead"]["traceparent"].split("-")[2] == own
    assert captured["kept"]["traceparent"] == published["traceparent"]  # never replaced


def test_nothing_is_added_or_imported_while_telemetry_is_off() -> None:
    assert get_listener() is None
    assert "traceparent" not in codec.wire_headers({}, message_id="m")
    script = (
        "import sys\n"
        "from msgpatterns import Consumer, InMemoryBroker\n"
        "from msgpatterns.batching import BatchExecutor\n"
        "b = InMemoryBroker(); b.publish('t', 1)\n"
        "Consumer(b, lambda m: None, topics=['t'], group='g').run_until_idle(timeout=10)\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_batch_sizes_and_flush_latency_match_the_counters(otel: Otel) -> None:
    sizes: list[int] = []
    with BatchExecutor("obs-batch", 4, lambda batch: sizes.append(len(batch)),
                       queue_size=16) as executor:
        for i in range(10):
            assert executor.add(i)
        assert executor.flush(timeout=10)
        counters = executor.counters
    (size,) = otel.points("msgpatterns.batch.size")
    (latency,) = otel.points("msgpatterns.batch.flush.duration")
    assert size.count == latency.count == counters.batches == len(sizes)
    assert size.sum == counters.processed == sum(sizes) == 10
    assert otel.total("msgpatterns.batch.items") == counters.items
    assert otel.total("msgpatterns.batch.processed") == counters.processed
    assert otel.total("msgpatterns.batch.batches") == counters.batches
    assert size.attributes == {"msgpatterns.queue": "obs-batch"}


def _scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_prometheus_endpoint_is_scraped_after_a_known_run() -> None:
    with serve_prometheus(port=0, duration_sample_rate=1.0) as endpoint:
        broker = InMemoryBroker()
        for i in range(10):
            broker.publish("orders", "poison" if i < 2 else "ok", key=f"k{i}")

        def handle(message: Message) -> None:
            if message.body == "poison":
                raise Reject("bad")

        stats = Consumer(broker, handle, topics=["orders"], group="prom").run_until_idle(
            timeout=10)
        samples = _scrape(endpoint.url)
    assert get_listener() is None  # close() uninstalled it

    def value(name: str, **labels: str) -> float:
        return sum(v for (n, ls), v in samples.items()
                   if n == name and set(labels.items()) <= ls)

    common = {"messaging_system": "memory", "messaging_consumer_group_name": "prom",
              "messaging_destination_name": "orders"}
    assert value("msgpatterns_consumer_deliveries_total", msgpatterns_outcome="acked",
                 **common) == stats.acked == 8
    assert value("msgpatterns_consumer_deliveries_total",
                 msgpatterns_outcome="dead_lettered", **common) == stats.dead_lettered == 2
    assert value("msgpatterns_consumer_fetched_total", messaging_system="memory") == 10
    assert value("messaging_process_duration_seconds_count", **common) == 10
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(endpoint.url, timeout=2)


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_log_lines_about_a_message_carry_its_fields(caplog: pytest.LogCaptureFixture) -> None:
    broker = InMemoryBroker()
    broker.publish("orders", "x", key="a")

    def handle(message: Message) -> None:
        raise ValueError("boom")

    consumer = Consumer(broker, handle, topics=["orders"], group="billing",
                        retry=RetryPolicy(max_attempts=2, backoff=Backoff.levels([1.0])))
    with caplog.at_level(logging.DEBUG, logger="msgpatterns.consumer"):
        consumer.run_until_idle(timeout=10)
    about = [r for r in caplog.records if "message" in r.getMessage()]
    assert len(about) >= 2  # the failure warning and the dead-letter error
    (published,) = broker.published
    for record in about:
        assert record.message_id == published.id  # type: ignore[attr-defined]
        assert record.topic == "orders"  # type: ignore[attr-defined]
        assert record.group == "billing"  # type: ignore[attr-defined]
    assert sorted(r.attempt for r in about) == [1, 2]  # type: ignore[attr-defined]


@pytest.mark.redis
def test_redis_publish_retry_and_dead_letter_carry_the_publishers_trace(
    otel: Otel, redis_url: str, unique: str,
) -> None:
    from msgpatterns.brokers import RedisStreamsBroker

    stream = f"obs-{unique}"
    tracer = otel.tracer_provider.get_tracer("test")
    with RedisStreamsBroker(redis_url) as broker:
        with tracer.start_as_current_span("publish", kind=SpanKind.PRODUCER) as producer:
            broker.publish(stream, b"x")  # no headers given: the adapter adds the context

        last_attempt = threading.Event()

        def handle(message: Message) -> None:
            if message.attempt == 2:
                last_attempt.set()
            raise ValueError("always")

        consumer = Consumer(broker, handle, topics=[stream], group="g",
                            retry=RetryPolicy(max_attempts=2, backoff=Backoff.levels([0.0])))
        consumer.start()
        try:
            assert last_attempt.wait(20)
        finally:
            consumer.stop(5)  # returns once the last attempt is settled (dead-lettered)
        (dead,) = broker.list_dead_letters(stream, "g")
    ctx = producer.get_span_context()
    spans = [s for s in otel.finished() if s.name == f"process {stream}"]
    assert [s.attributes["messaging.msgpatterns.attempt"] for s in spans] == [1, 2]
    assert all(s.parent is not None and s.parent.span_id == ctx.span_id for s in spans)
    assert dead.message.headers["traceparent"].split("-")[1] == format(ctx.trace_id, "032x")


def test_a_late_ack_warning_carries_the_message_fields(caplog: pytest.LogCaptureFixture) -> None:
    message = Message(b"x", id="m-7", key="k", topic="orders", attempt=3)
    message.disable_auto_ack()
    assert message.ack()
    with caplog.at_level(logging.WARNING, logger="msgpatterns.message"):
        assert not message.ack()  # the second ack is ignored, with a warning
    (record,) = caplog.records
    assert (record.message_id, record.topic, record.attempt) == (  # type: ignore[attr-defined]
        "m-7", "orders", 3)


def test_transactional_checker_round_trips_are_reported_under_its_name(
    otel: Otel, tmp_path: Any
) -> None:
    import sqlalchemy as sa

    from msgpatterns import TransactionalSqlChecker, idempotent

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'tx.db'}")
    checker = TransactionalSqlChecker(engine)

    @idempotent(checker)
    def handle(message: Message, tx: sa.Connection) -> None:
        pass

    broker = InMemoryBroker(seed=2)
    for i in range(5):
        broker.publish("orders", b"x", key=f"o{i}")
    Consumer(broker, handle, topics=["orders"], group="g").run_until_idle(timeout=10)
    name = "msgpatterns.idempotency.store.round_trips"
    points = [p for p in otel.points(name)
              if "TransactionalSqlChecker" in p.attributes.values()]
    by_operation = {p.attributes.get("msgpatterns.operation"): int(p.value) for p in points}
    assert by_operation == {"claim": 5, "commit": 5}
    engine.dispose()


def test_counts_stay_exact_per_consumer_as_consumers_come_and_go(otel: Otel) -> None:
    """The listener caches each consumer's series (by identity, topics included);
    consumers created and dropped one after another - possibly at the same address -
    still get exactly their own counts, per topic and outcome."""
    import gc

    expected: Counter[tuple[str, str, str]] = Counter()
    for round_ in range(6):
        broker = InMemoryBroker()
        group = f"g{round_ % 3}"
        topics = ["a", "b"] if round_ % 2 else ["a"]
        for i in range(5 + round_):
            broker.publish(topics[i % len(topics)], "poison" if i % 4 == 3 else "ok")

        def handle(message: Message) -> None:
            if message.body == "poison":
                raise Reject("bad")

        stats = Consumer(broker, handle, topics=topics, group=group).run_until_idle(
            timeout=10)
        for i in range(5 + round_):
            outcome = "dead_lettered" if i % 4 == 3 else "acked"
            expected[group, topics[i % len(topics)], outcome] += 1
        assert stats.acked + stats.dead_lettered == 5 + round_
        del broker, handle
        gc.collect()
    for (group, topic, outcome), count in expected.items():
        assert otel.total("msgpatterns.consumer.deliveries", **{
            "messaging.consumer.group.name": group, "messaging.destination.name": topic,
            "msgpatterns.outcome": outcome}) == count, (group, topic, outcome)
    assert sum(p.count for p in otel.points("messaging.process.duration")) \
        == sum(expected.values())
