"""``max_message_bytes`` on every broker adapter: a delivery larger than the bound is
dead-lettered with a reason naming its size and the bound, never handed to the handler;
the message after it is delivered and the consumer keeps running.

Each adapter (sync and async where both exist) gets ``[small, 5,000-byte body, small]``
with ``max_message_bytes=1000`` on its real server (Kafka: librdkafka's mock cluster),
consumed by a :class:`~msgpatterns.Consumer` / :class:`~msgpatterns.aio.AsyncConsumer`.
Before the bound was wired in, the 5,000-byte message reached the handler.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker_harness import (
    KAFKA_TEST_CONSUMER,
    delete_nats_stream,
    delete_rabbitmq_topology,
    drain,
    eventually,
    kafka_cluster,
    require_library,
)
from msgpatterns import Consumer, Message
from msgpatterns.brokers.kafka._records import RecordView, judge
from msgpatterns.errors import ConfigurationError
from msgpatterns.limits import DEFAULT_MAX_MESSAGE_BYTES
from msgpatterns.testing import services

pytestmark = [pytest.mark.timeout(120)]

LIMIT = 1000
SMALL_1, BIG, SMALL_2, LATER = b"small-1", b"B" * 5000, b"small-2", b"later"
BODIES = [SMALL_1, BIG, SMALL_2]


@dataclass
class Names:
    topic: str
    group: str


@dataclass
class Adapter:
    """One adapter: its class (``module:Name``), the options it is built with, its
    server, and the sync adapter whose dead-letter admin reads what it buried."""

    name: str
    service: str  # services.require() name, or "kafka" for the mock cluster
    library: str  # the client library it needs
    path: str
    options: dict[str, Any] = field(default_factory=dict)
    is_async: bool = False

    def cls(self) -> Any:
        module, _, name = self.path.partition(":")
        return getattr(importlib.import_module(module), name)

    def make(self, url: str, **options: Any) -> Any:
        return self.cls()(url, **self.options, **options)

    def url(self) -> str:
        if self.service == "kafka":
            return str(kafka_cluster().bootstrap_servers)
        return services.require(self.service)

    def admin(self, url: str) -> Any:
        """A sync broker on the same server, for its dead-letter admin."""
        return ADAPTERS[self.service].make(url)

    def cleanup(self, url: str, names: Names) -> None:
        if self.service == "redis":
            import redis

            client = redis.Redis.from_url(url)
            try:
                keys = list(client.scan_iter(match=f"{names.topic}*"))
                if keys:
                    client.delete(*keys)
            finally:
                client.close()
        elif self.service == "rabbitmq":
            delete_rabbitmq_topology(url, names.topic, names.group)
        elif self.service == "nats":
            delete_nats_stream(url, names.topic)


AIOKAFKA_TEST_CONSUMER = {"fetch_max_wait_ms": 50, "session_timeout_ms": 4000,
                          "heartbeat_interval_ms": 1000}

ADAPTERS: dict[str, Adapter] = {a.name: a for a in [
    Adapter("redis", "redis", "redis", "msgpatterns.brokers:RedisStreamsBroker"),
    Adapter("redis-async", "redis", "redis",
            "msgpatterns.aio.redis_streams:AsyncRedisStreamsBroker", is_async=True),
    Adapter("rabbitmq", "rabbitmq", "pika", "msgpatterns.brokers:RabbitMQBroker"),
    Adapter("rabbitmq-async", "rabbitmq", "aio_pika",
            "msgpatterns.aio.rabbitmq:AsyncRabbitMQBroker", is_async=True),
    Adapter("kafka", "kafka", "confluent_kafka", "msgpatterns.brokers:KafkaBroker",
            {"consumer_config": KAFKA_TEST_CONSUMER}),
    Adapter("kafka-async", "kafka", "aiokafka",
            "msgpatterns.aio.kafka_native:AIOKafkaBroker",
            {"consumer_config": AIOKAFKA_TEST_CONSUMER}, is_async=True),
    Adapter("nats", "nats", "nats", "msgpatterns.brokers:NatsJetStreamBroker"),
    Adapter("nats-async", "nats", "nats", "msgpatterns.aio:AsyncNatsJetStreamBroker",
            is_async=True),
]}

MARKS = {"redis": pytest.mark.redis, "rabbitmq": pytest.mark.rabbitmq,
         "kafka": pytest.mark.kafka, "nats": pytest.mark.nats}


def adapter_params() -> list[Any]:
    return [pytest.param(a, marks=[MARKS[a.service]], id=a.name)
            for a in ADAPTERS.values()]


@pytest.fixture(params=adapter_params())
def adapter(request: pytest.FixtureRequest) -> Adapter:
    a: Adapter = request.param
    require_library(a.library, a.path)
    if a.service == "kafka":
        require_library("confluent_kafka", "the Kafka mock cluster")
    return a


@pytest.fixture
def names() -> Names:
    suffix = uuid.uuid4().hex[:10]
    return Names(f"size-{suffix}", f"g-{suffix}")


def _consume_sync(adapter: Adapter, url: str, names: Names) -> list[bytes]:
    handled: list[bytes] = []
    two, three = threading.Event(), threading.Event()

    def handler(message: Message) -> None:
        handled.append(message.raw_body)
        if len(handled) == 2:
            two.set()
        elif len(handled) == 3:
            three.set()

    with adapter.make(url, max_message_bytes=LIMIT) as broker:
        if hasattr(broker, "subscribe"):
            broker.subscribe(names.topic, names.group)
        for body in BODIES:
            broker.publish(names.topic, body)
        consumer = Consumer(broker, handler, topics=[names.topic], group=names.group)
        consumer.start()
        try:
            assert two.wait(60), f"handled only {handled!r}"
            broker.publish(names.topic, LATER)  # the consumer goes on
            assert three.wait(60), f"handled only {handled!r}"
            assert consumer.health().running
        finally:
            consumer.stop(timeout=30)
    return handled


def _consume_async(adapter: Adapter, url: str, names: Names) -> list[bytes]:
    from msgpatterns.aio import AsyncConsumer

    handled: list[bytes] = []

    async def run() -> None:
        two, three = asyncio.Event(), asyncio.Event()

        async def handler(message: Message) -> None:
            handled.append(message.raw_body)
            if len(handled) == 2:
                two.set()
            elif len(handled) == 3:
                three.set()

        broker = adapter.make(url, max_message_bytes=LIMIT)
        try:
            if hasattr(broker, "subscribe"):
                await broker.subscribe(names.topic, names.group)
            for body in BODIES:
                await broker.publish(names.topic, body)
            consumer = AsyncConsumer(broker, handler, topics=[names.topic],
                                     group=names.group)
            await consumer.start()
            try:
                await asyncio.wait_for(two.wait(), 60)
                await broker.publish(names.topic, LATER)  # the consumer goes on
                await asyncio.wait_for(three.wait(), 60)
            finally:
                await consumer.stop(timeout=30)
        finally:
            await broker.close()

    asyncio.run(run())
    return handled


def test_an_oversized_message_is_dead_lettered_and_the_next_one_delivered(
        adapter: Adapter, names: Names) -> None:
    url = adapter.url()
    try:
        consume = _consume_async if adapter.is_async else _consume_sync
        handled = consume(adapter, url, names)
        assert sorted(handled[:2]) == [SMALL_1, SMALL_2]  # never the big one
        assert handled[2:] == [LATER]

        with adapter.admin(url) as admin_broker:
            admin = admin_broker.dead_letter_admin()
            dead = eventually(
                lambda: admin.list_dead_letters(names.topic, names.group) or None,
                timeout=30)
        assert len(dead) == 1, dead
        [record] = dead
        assert BIG in record.message.raw_body  # kept (Redis: its raw field)
        assert "max_message_bytes=1000" in record.reason, record.reason
        assert "5000" in record.reason, record.reason
        assert record.group == names.group
        assert record.error_type == "msgpatterns.limits.MessageTooLarge"
    finally:
        adapter.cleanup(url, names)


@pytest.mark.parametrize("bad", [0, -1, True, "x", 1.5])
def test_a_bad_bound_is_a_configuration_error(adapter: Adapter, bad: object) -> None:
    """Refused before anything connects (no server needed)."""
    url = {"redis": "redis://127.0.0.1:1", "rabbitmq": "amqp://127.0.0.1:1/",
           "kafka": "127.0.0.1:1", "nats": "nats://127.0.0.1:1"}[adapter.service]
    with pytest.raises(ConfigurationError, match="max_message_bytes"):
        adapter.make(url, max_message_bytes=bad)


def test_every_adapter_defaults_to_16_mib(adapter: Adapter) -> None:
    default = inspect.signature(adapter.cls()).parameters["max_message_bytes"].default
    assert default == DEFAULT_MAX_MESSAGE_BYTES == 16 * 1024 * 1024


# -- the Kafka sans-I/O core ------------------------------------------------------------


def _record(value: bytes, headers: tuple[tuple[str, Any], ...] = (),
            key: bytes | None = None) -> RecordView:
    return RecordView("t", 0, 7, key, value, headers, None)


def test_kafka_judge_rejects_a_record_over_the_bound() -> None:
    now = time.time()
    verdict = judge(_record(b"x" * 11), {}, "g", now, limit=10)
    assert verdict.action == "reject"
    assert verdict.problem == "the message body is 11 bytes, over max_message_bytes=10"
    headers = judge(_record(b"x" * 5, (("h", b"12345"),), key=b"k"), {}, "g", now, limit=10)
    assert headers.action == "reject" and "body 5" in (headers.problem or "")
    assert judge(_record(b"x" * 10), {}, "g", now, limit=10).action == "deliver"
    assert judge(_record(b"x" * 11), {}, "g", now, limit=None).action == "deliver"


# -- Redis: headers count, foreign entries, no bound, and the hot loop's twin ------------


@pytest.mark.redis
def test_redis_headers_and_foreign_fields_count(names: Names) -> None:
    """An entry whose headers push it over, and a foreign entry (no ``body`` field)
    with a large field, are dead-lettered; with ``max_message_bytes=None`` a 5,000-byte
    body is delivered."""
    require_library("redis", "RedisStreamsBroker")
    import redis

    from msgpatterns.brokers import RedisStreamsBroker

    url = services.require("redis")
    client = redis.Redis.from_url(url)
    try:
        with RedisStreamsBroker(url, max_message_bytes=LIMIT) as broker:
            broker.subscribe(names.topic, names.group)
            client.xadd(names.topic, {"body": b"b" * 500,
                                      "headers": '{"h": "%s"}' % ("v" * 800)})
            client.xadd(names.topic, {"order": "o" * 2000})
            client.xadd(names.topic, {"body": SMALL_1})
            got = drain(broker, names.topic, names.group, count=1, within=15)
            assert [m.raw_body for m in got] == [SMALL_1]
            broker.ack(got[0])
            dead = eventually(lambda: (lambda d: d if len(d) == 2 else None)(
                broker.list_dead_letters(names.topic, names.group)), timeout=15)
        reasons = sorted(d.reason for d in dead)
        assert all("over max_message_bytes=1000" in r for r in reasons), reasons
        assert any("(body 500, headers and key" in r for r in reasons), reasons
        assert all(d.error_type.endswith("MessageTooLarge") for d in dead)
        with RedisStreamsBroker(url, max_message_bytes=None) as unbounded:
            unbounded.publish(names.topic, BIG)
            got = drain(unbounded, names.topic, f"{names.group}-none", count=4, within=15)
        assert BIG in [m.raw_body for m in got]
    finally:
        keys = list(client.scan_iter(match=f"{names.topic}*"))
        if keys:
            client.delete(*keys)
        client.close()


def _view(message: Message) -> tuple[Any, ...]:
    return (message.raw_body, message.id, message.key, message.topic, message.headers,
            message.timestamp, message.attempt, tuple(message.receipt))


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.lists(st.tuples(st.integers(0, 40), st.booleans()), max_size=12),
       limit=st.sampled_from([None, 1, 10, 25, 40]))
def test_redis_hot_loop_agrees_with_its_plain_twin(entries: list[tuple[int, bool]],
                                                   limit: int | None) -> None:
    """``RedisStreamsBroker._messages`` (the tight loop over a raw XREADGROUP reply)
    hands out and dead-letters exactly what :meth:`_message`, entry by entry, does."""
    require_library("fakeredis", "the Redis fake")
    import fakeredis

    from msgpatterns.brokers import RedisStreamsBroker

    def reply() -> list[Any]:
        out = []
        for i, (size, with_headers) in enumerate(entries):
            fields: list[bytes] = [b"body", b"x" * size]
            if with_headers:
                fields += [b"headers", b'{"h": "v"}']
            out.append([f"1700000000000-{i}".encode(), fields])
        return [[b"t", out]]

    broker: Any = RedisStreamsBroker(fakeredis.FakeRedis(), max_message_bytes=limit)
    try:
        buried: dict[str, list[Any]] = {"hot": [], "plain": []}
        for way in ("hot", "plain"):
            broker._bury = lambda m, r, way=way: buried[way].append(
                (m.raw_body, m.id, r.reason, r.error_type))
            if way == "hot":
                hot = [_view(m) for m in broker._messages(reply(), {"t": ("t", False)}, "g")]
            else:
                plain = [_view(m) for entry_id, fields in reply()[0][1]
                         if (m := broker._message("t", "t", False, "g", entry_id, fields, 1))
                         is not None]
        assert hot == plain
        assert buried["hot"] == buried["plain"]
        expected = sum(1 for size, headers in entries
                       if limit is not None and size + (17 if headers else 0) > limit)
        assert len(buried["hot"]) == expected
    finally:
        broker.close()
