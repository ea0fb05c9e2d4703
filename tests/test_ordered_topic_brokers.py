"""The same ordered-topic conformance cases on every broker's mapping: a physical
partition is a Redis stream, a RabbitMQ queue, a Kafka topic (mock cluster), a NATS
JetStream subject, an InMemoryBroker topic. Each consumer has its own broker
connection; per-key order holds across splits, merges, moves and a consumer crash,
nothing is lost and nothing is doubled with ``@idempotent``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker_harness import Harness, eventually, harness_params, make_harness
from msgpatterns.brokers import Broker, InMemoryBroker
from msgpatterns.ordering import MemoryRouteStore, OrderedTopic
from ordered_topic_runner import Options, assert_ordered_exactly_once, run_schedule

_PROFILE = os.environ.get("MSGPATTERNS_SOAK", "")
#: Schedules per real broker: 50 in CI, 1,000 in a soak, 3 on a laptop.
SCHEDULES = {"soak": 1_000, "ci": 10}.get(_PROFILE, 3)

#: A fixed schedule that exercises every kind of change.
EVERY_CHANGE = ([("publish", 7, 0)] * 3 + [("split", 0, 0)] + [("publish", 7, 0)] * 3
                + [("merge", 0, 0), ("publish", 7, 0), ("move", 1, 0), ("publish", 7, 0)])


@pytest.fixture(params=harness_params())
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from make_harness(request.param)


@pytest.fixture
def topic_name(harness: Harness) -> Iterator[Callable[[], str]]:
    """New ordered-topic names; every partition they got on the server is deleted
    afterwards (RabbitMQ: queues, dead-letter queues and exchanges - hundreds of idle
    ``ot-*`` quorum queues once hung the server; Redis: the streams)."""
    names: list[str] = []

    def new() -> str:
        names.append(f"ot-{uuid.uuid4().hex[:8]}")
        return names[-1]

    yield new
    for name in names:
        delete_partitions(harness, name)


def delete_partitions(harness: Harness, name: str, group: str = "g",
                      most: int = 64) -> None:
    """Delete ``name``'s partitions ``name.0`` .. ``name.<most>`` (partition ids are
    handed out in order: a schedule of at most a few dozen changes stays below)."""
    if harness.name == "rabbitmq":
        import pika

        conn = pika.BlockingConnection(pika.URLParameters(harness.url))  # type: ignore[attr-defined]
        try:
            channel = conn.channel()
            for physical in range(most + 1):
                queue = f"{name}.{physical}.{group}"
                for doomed in (queue, f"{queue}.dlq"):
                    channel.queue_delete(doomed)
                channel.exchange_delete(f"{name}.{physical}")
        finally:
            conn.close()
    elif harness.name == "redis":
        client = harness.client  # type: ignore[attr-defined]
        keys = list(client.scan_iter(match=f"{name}.*"))
        if keys:
            client.delete(*keys)


#: Mappings that do not pass yet, with the reason (none now: the RabbitMQ adapter lets
#: go of a partition's queue when its fetch no longer names it; a Kafka publisher's
#: ``subscribe`` no longer joins the group and holds partitions nobody reads).
KNOWN_GAPS: dict[tuple[str, str], str] = {}

#: Seen once each and not diagnosed yet (not strict: they pass in other runs), so they
#: run without gating CI: crash[nats] put a key's message out of order in the
#: fresh-clone CI run of dc10851 (with the batch refill on, since turned off by default).
FLAKY: dict[tuple[str, str], str] = {
    ("crash", "nats"): "NATS: one crash/takeover run put a key out of order (CI, dc10851)",
    ("every_change/async", "kafka"): (
        "Kafka, asyncio consumer: 62 of 64 handled in the wait once with the batch refill "
        "off (passed with it on, after KafkaBroker.idle); a stall, not a loss"),
}


def flaky(request: pytest.FixtureRequest, case: str, harness: Harness) -> None:
    reason = FLAKY.get((case, harness.name))
    if reason is not None:
        request.applymarker(pytest.mark.xfail(strict=False, reason=reason))


def known_gap(case: str, harness: Harness) -> None:
    reason = KNOWN_GAPS.get((case, harness.name))
    if reason is not None:
        pytest.xfail(reason)


def brokers(harness: Harness) -> Callable[[], Broker]:
    """A new broker connection per call (one InMemoryBroker with a short visibility
    timeout for the in-memory mapping)."""
    if harness.name == "memory":
        shared = InMemoryBroker(visibility_timeout=0.3, record_history=False)
        return lambda: shared
    return harness.broker


def crash(harness: Harness) -> Callable[[Broker], None] | None:
    """What a killed process leaves behind on the broker (memory: nothing to do, the
    visibility timeout runs on)."""
    return None if harness.name == "memory" else harness.crash


def options_for(harness: Harness) -> Options:
    # The harnesses' brokers redeliver a dead consumer's messages within about a second.
    visibility = 0.3 if harness.name == "memory" else 1.0
    return Options(lease_ttl=2.0, refresh=0.05, takeover_delay=visibility + 0.5,
                   poll_timeout=0.05)


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_every_change_keeps_per_key_order(harness: Harness, topic_name: Callable[[], str],
                                          driver: str, request: pytest.FixtureRequest) -> None:
    """On both drivers: ``OrderedTopic.consumer`` and ``async_consumer``."""
    known_gap("every_change", harness)
    flaky(request, f"every_change/{driver}", harness)
    name = topic_name()
    result = run_schedule(brokers(harness), MemoryRouteStore(), EVERY_CHANGE, seed=1,
                          name=name, options=options_for(harness), driver=driver)
    assert_ordered_exactly_once(result)
    assert [r.kind for r in result["routes"]] == ["create", "split", "merge", "move"]


def test_a_crashed_consumer_is_taken_over_in_order(harness: Harness,
                                                   topic_name: Callable[[], str],
                                                   request: pytest.FixtureRequest) -> None:
    known_gap("crash", harness)
    flaky(request, "crash", harness)
    name = topic_name()
    steps = [("publish", 7, 0)] * 3 + [("crash", 0, 0)] + [("publish", 7, 0)] * 3
    result = run_schedule(brokers(harness), MemoryRouteStore(), steps, seed=2, name=name,
                          options=options_for(harness), on_crash=crash(harness))
    assert_ordered_exactly_once(result)
    assert result["crashes"] == 1


@settings(max_examples=SCHEDULES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(steps=st.lists(
    st.tuples(st.sampled_from(["publish", "publish", "publish", "split", "merge", "move",
                               "crash"]),
              st.integers(0, 1000), st.integers(0, 1000)),
    min_size=1, max_size=10), seed=st.integers(0, 2**32 - 1))
def test_random_schedules_with_crashes_keep_per_key_order(
        harness: Harness, topic_name: Callable[[], str],
        steps: list[tuple[str, int, int]], seed: int) -> None:
    known_gap("random", harness)
    if any(kind == "crash" for kind, _, _ in steps):
        known_gap("crash", harness)
    known_gap("every_change", harness)
    name = topic_name()
    result = run_schedule(brokers(harness), MemoryRouteStore(), steps, seed=seed, name=name,
                          options=options_for(harness), on_crash=crash(harness))
    assert_ordered_exactly_once(result)


@pytest.mark.redis
def test_a_foreign_publisher_without_a_route_is_dead_lettered_not_handled(
        redis_url: str) -> None:
    """``redis-cli XADD`` straight into a partition stream: no route version, so the
    message is dead-lettered with the reason and the routed messages go on."""
    import shutil
    import subprocess
    from urllib.parse import urlsplit

    import redis

    from msgpatterns import Message
    from msgpatterns.brokers import RedisStreamsBroker

    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.skip("redis-cli is not installed")
    name = f"ot-foreign-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    publisher = OrderedTopic(RedisStreamsBroker(redis_url), name, routes=MemoryRouteStore(),
                             logic_partitions=8, route_cache=0.0, fence=0.0, groups=["g"])
    consumer_broker = RedisStreamsBroker(redis_url)
    handled: list[str] = []
    try:
        publisher.create(physical=1)
        publisher.publish("a", "routed-1")
        url = urlsplit(redis_url)
        subprocess.run([cli, "-h", url.hostname or "127.0.0.1", "-p", str(url.port or 6379),
                        "-n", url.path.strip("/") or "0", "XADD",
                        publisher.partition_topic(0), "*", "body", "foreign $(x) \x1b[31m"],
                       check=True, capture_output=True, timeout=30)
        publisher.publish("a", "routed-2")
        topic = OrderedTopic(consumer_broker, name, routes=publisher.store,
                             logic_partitions=8, route_cache=0.0, fence=0.0)

        def handle(message: Message) -> None:
            handled.append(bytes(message.body).decode())

        consumer = topic.consumer(handle, group="g", refresh=0.05, poll_timeout=0.05)
        consumer.start()
        try:
            eventually(lambda: len(handled) >= 2, timeout=30, message="routed messages")
            dead = eventually(lambda: client.xrange(
                RedisStreamsBroker.dead_letter_stream(publisher.partition_topic(0))),
                timeout=30, message="the foreign message's dead letter")
        finally:
            consumer.stop(10)
            consumer.broker.close()
        assert handled == ["routed-1", "routed-2"]
        assert len(dead) == 1
        record = repr(dead[0][1])
        assert "UnroutedMessage" in record and "no route version" in record
    finally:
        publisher.broker.close()  # type: ignore[attr-defined]
        consumer_broker.close()
        keys = list(client.scan_iter(match=f"{name}*"))
        if keys:
            client.delete(*keys)
        client.close()
