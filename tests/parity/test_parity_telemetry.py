"""Parity: telemetry and health (issue 14; DESIGN 12 "two drivers, one contract") - the
same CONSUMER spans, the same metrics (``msgpatterns.consumer.fetched`` ...) equal to the
consumer's own counts, and the same ``health()`` served by ``HealthServer`` - on both
drivers, one test body each."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from msgpatterns import Backoff, InMemoryBroker, Message, NeedRetry, Reject, RetryPolicy
from msgpatterns.errors import PartialFailure
from msgpatterns.idempotency import MemoryChecker
from msgpatterns.observability import HealthServer, trace_headers
from two_drivers import Driver, Otel, eventually

pytestmark = pytest.mark.timeout(90)


def _workload_body(message: Message) -> None:
    if message.body == "poison":
        raise Reject("bad order")
    if message.body == "flaky" and message.attempt == 1:
        raise ValueError("flaky downstream")
    if message.body == "local" and message.local_retries == 0:
        raise NeedRetry()


@pytest.mark.parametrize("idempotent", [False, True], ids=["plain", "idempotent"])
def test_spans_and_metrics_equal_the_consumers_own_counts(driver: Driver, otel: Otel,
                                                          idempotent: bool) -> None:
    """Most succeed, 'flaky' fail their first attempt (redelivered), 'local' ask for
    one in-process retry, 'poison' are rejected (dead letter); the broker duplicates
    deliveries (an @idempotent handler skips them: settled without running)."""
    broker = InMemoryBroker(seed=3, duplicate_rate=0.3)
    bodies = ["ok"] * 20 + ["flaky"] * 4 + ["local"] * 4 + ["poison"] * 2
    for i, body in enumerate(bodies):
        broker.publish("orders", body, key=f"k{i}")
    checker = MemoryChecker(namespace="obs")
    handler = driver.idempotent(checker, _workload_body) if idempotent \
        else driver.handler(_workload_body)
    consumer = driver.consumer(broker, handler, topics=["orders"], group="billing",
                               workers=2, retry=RetryPolicy(max_attempts=3,
                                                            backoff=Backoff.levels([0.5])))
    stats = consumer.run_until_idle(timeout=30)
    assert stats.dead_lettered >= 2 and stats.redelivered >= 4 and stats.retried_locally >= 4

    spans = otel.finished()
    outcomes = Counter(s.attributes["messaging.msgpatterns.outcome"] for s in spans)
    assert outcomes == Counter({"acked": stats.acked, "retried_later": stats.redelivered,
                                "retried_locally": stats.retried_locally,
                                "dead_lettered": stats.dead_lettered})
    assert len(spans) == stats.acked + stats.failed
    for span in spans:
        attrs = span.attributes
        assert span.kind.name == "CONSUMER" and span.name == "process orders"
        assert attrs["messaging.system"] == "memory"
        assert attrs["messaging.destination.name"] == "orders"
        assert attrs["messaging.consumer.group.name"] == "billing"
        assert attrs["messaging.operation.type"] == "process"
        assert attrs["messaging.message.id"] and attrs["messaging.msgpatterns.key"]
        assert attrs["messaging.msgpatterns.attempt"] >= 1
        failed = attrs["messaging.msgpatterns.outcome"] != "acked"
        assert (span.status.status_code.name == "ERROR") == failed
    assert {s.attributes["error.type"] for s in spans if "error.type" in s.attributes} == {
        "ValueError", "msgpatterns.errors.NeedRetry", "msgpatterns.errors.Reject"}

    deliveries = "msgpatterns.consumer.deliveries"
    for outcome, count in (("acked", stats.acked), ("retried_later", stats.redelivered),
                           ("retried_locally", stats.retried_locally),
                           ("dead_lettered", stats.dead_lettered),
                           ("released", stats.released)):
        assert otel.total(deliveries, **{"msgpatterns.outcome": outcome}) == count, outcome
    assert otel.total("msgpatterns.consumer.fetched") == stats.fetched > 0
    assert otel.total("msgpatterns.consumer.failed") == stats.failed
    assert sum(p.count for p in otel.points("messaging.process.duration")) == len(spans)
    (gauge,) = otel.points("msgpatterns.consumer.in_flight")
    assert gauge.value == 0 and gauge.attributes["msgpatterns.consumer"] == consumer.consumer.name
    if idempotent:
        cs = checker.stats
        assert cs.duplicates > 0  # the broker duplicated and the checker skipped
        for name, value in cs.as_dict().items():
            assert otel.total(f"msgpatterns.idempotency.{name}") == value, name

        def trips(*operations: str) -> int:
            return sum(otel.total("msgpatterns.idempotency.store.round_trips",
                                  **{"msgpatterns.operation": op}) for op in operations)

        # An @idempotent handler's keys are claimed and completed per batch: one round
        # trip for many keys (never more round trips than keys).
        claims = cs.claimed + cs.duplicates + cs.in_progress + cs.conflicts
        assert 0 < trips("claim", "claim_many") < claims
        assert 0 < trips("complete", "complete_many") <= cs.completed + cs.lost_leases


def test_the_span_continues_the_publishers_trace_and_is_current_in_the_handler(
        driver: Driver, otel: Otel) -> None:
    broker = InMemoryBroker()
    tracer = otel.tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("publish orders") as producer:
        broker.publish("orders", "x", key="a", headers=trace_headers())
    seen: list[Any] = []

    def body(message: Message) -> None:
        from opentelemetry import trace

        seen.append(trace.get_current_span().get_span_context())
        if message.attempt < 3:
            raise ValueError("again")

    consumer = driver.consumer(broker, driver.handler(body), topics=["orders"],
                               retry=RetryPolicy(max_attempts=5, backoff=Backoff.levels([1.0])))
    assert consumer.run_until_idle(timeout=10).acked == 1
    spans = [s for s in otel.finished() if s.name == "process orders"]
    assert len(spans) == 3
    ctx = producer.get_span_context()
    for span in spans:
        assert span.context.trace_id == ctx.trace_id
        assert span.parent is not None and span.parent.span_id == ctx.span_id
    assert [c.span_id for c in seen] == [s.context.span_id for s in spans]
    assert [s.attributes["messaging.msgpatterns.attempt"] for s in spans] == [1, 2, 3]


def test_a_batch_handler_has_a_span_per_message(driver: Driver, otel: Otel) -> None:
    broker = InMemoryBroker()
    for i in range(6):
        broker.publish("orders", i, id=f"o-{i}")

    def body(messages: Sequence[Message]) -> None:
        failures = {m: ValueError("odd") for m in messages if m.body % 2 and m.attempt == 1}
        if failures:
            raise PartialFailure(failures)

    consumer = driver.consumer(broker, driver.handler(body), topics=["orders"], batch=True,
                               retry=RetryPolicy(backoff=Backoff.fixed(1.0), local_retries=0))
    stats = consumer.run_until_idle(timeout=30)
    assert (stats.acked, stats.redelivered) == (6, 3)
    spans = otel.finished()
    by_id = Counter((s.attributes["messaging.message.id"],
                     s.attributes["messaging.msgpatterns.outcome"]) for s in spans)
    assert by_id == Counter({**{(f"o-{i}", "acked"): 1 for i in range(6)},
                             **{(f"o-{i}", "retried_later"): 1 for i in (1, 3, 5)}})
    assert otel.total("msgpatterns.consumer.fetched") == stats.fetched == 9


def test_ack_timeouts_and_broker_errors_are_exported(driver: Driver, otel: Otel) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"x")
    fetch = broker.fetch
    failed_once: list[bool] = []

    def flaky_fetch(*args: Any, **kwargs: Any) -> Any:
        if not failed_once:
            failed_once.append(True)
            raise ConnectionError("broker away")
        return fetch(*args, **kwargs)

    broker.fetch = flaky_fetch  # type: ignore[method-assign]

    def body(message: Message) -> None:
        if message.attempt == 1:
            message.disable_auto_ack()  # never acked: its deadline fails it

    stats = driver.consumer(broker, driver.handler(body), ack_timeout=0.05, poll_timeout=0.05,
                            retry=RetryPolicy(backoff=Backoff.fixed(1.0))).run_until_idle(30)
    assert (stats.broker_errors, stats.ack_timeouts, stats.acked) == (1, 1, 1)
    assert otel.total("msgpatterns.consumer.broker_errors") == 1
    assert otel.total("msgpatterns.consumer.ack_timeouts") == 1
    assert otel.total("msgpatterns.consumer.fetched") == stats.fetched == 2


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_health_over_http_follows_the_consumer(driver: Driver) -> None:
    broker = InMemoryBroker()
    held = threading.Event()
    kept: list[Message] = []

    def body(message: Message) -> None:
        message.disable_auto_ack()  # stays unsettled: in flight, ageing
        kept.append(message)
        held.set()

    consumer = driver.consumer(broker, driver.handler(body), ack_timeout=0)
    with HealthServer(consumer.consumer, port=0) as server:
        status, answer = _get(server.url + "/livez")
        assert status == 503 and answer["consumers"][0]["state"] == "new"
        assert consumer.health().last_fetch_at is None
        consumer.start()
        broker.publish("t", "x")
        assert held.wait(10)
        health = consumer.health()  # from the test's thread
        assert health.running and health.live and health.ready
        assert health.last_fetch_ok and health.broker_connected
        assert health.in_flight == 1 and health.oldest_unsettled_age is not None
        assert health.name == consumer.consumer.name
        assert _get(server.url + "/livez")[0] == 200
        status, answer = _get(server.url + "/readyz")
        assert status == 200 and answer["ok"] is True
        assert answer["consumers"][0]["in_flight"] == 1
        assert answer["consumers"][0]["state"] == "running"
        assert _get(server.url + "/nope")[0] == 404
        kept[0].ack()
        eventually(lambda: consumer.health().in_flight == 0)
        assert consumer.health().oldest_unsettled_age is None
        consumer.stop(5)
        assert consumer.health().state == "stopped"
        assert _get(server.url + "/livez")[0] == 503
        assert _get(server.url + "/readyz")[0] == 503
        url = server.url
    with pytest.raises(urllib.error.URLError):  # the block's end closed the server
        urllib.request.urlopen(url + "/livez", timeout=2)
    server.close()  # idempotent


def test_health_is_not_ready_while_fetches_fail(driver: Driver) -> None:
    broker = InMemoryBroker()

    def down(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("broker away")

    broker.fetch = down  # type: ignore[method-assign]
    consumer = driver.consumer(broker, driver.handler(lambda m: None), poll_timeout=0.05)
    consumer.start()
    try:
        eventually(lambda: consumer.stats.broker_errors >= 1)
        health = consumer.health()
        assert health.live and not health.ready
        assert health.last_fetch_ok is False and health.broker_connected is False
    finally:
        consumer.stop(5)


def test_health_server_serves_both_drivers_at_once() -> None:
    """One HealthServer probes a Consumer and an AsyncConsumer together."""
    from two_drivers import driver_named

    with driver_named("sync") as sync, driver_named("async") as aio:
        broker = InMemoryBroker()
        first = sync.consumer(broker, sync.handler(lambda m: None), group="a")
        second = aio.consumer(broker, aio.handler(lambda m: None), group="b")
        with HealthServer(first.consumer, second.consumer, port=0) as server:
            first.start()
            second.start()
            try:
                broker.publish("t", "x")
                eventually(lambda: first.stats.acked == second.stats.acked == 1)
                status, answer = _get(server.url + "/readyz")
                assert status == 200
                assert [c["state"] for c in answer["consumers"]] == ["running", "running"]
            finally:
                first.stop(5)
                second.stop(5)
            assert _get(server.url + "/livez")[0] == 503
