"""The broker conformance suite for the async adapters: the async fake, Redis Streams
on redis.asyncio, RabbitMQ on aio-pika, NATS JetStream on nats-py (real servers) and
Kafka (librdkafka's mock cluster), with the rules of tests/test_conformance.py
(DESIGN 2, 3, 7): publish/fetch/ack; a nack delay is honoured and the retry carries the
original payload and the headers at nack time; the attempt count survives redelivery,
restart and crash; max_attempts ends in a full dead letter; an undecodable body is
dead-lettered and the consumer keeps going; max_in_flight holds. Plus the shared wire
format: a message retried by the sync adapter is read by the async one and back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from broker_harness import (
    KAFKA_TEST_CONSUMER,
    delete_nats_stream,
    delete_rabbitmq_topology,
    kafka_cluster,
    require_library,
)
from broker_harness import drain as sync_drain
from msgpatterns import Backoff, Message, RetryPolicy
from msgpatterns.aio import AsyncConsumer, AsyncInMemoryBroker
from msgpatterns.deadletter import DeadLetter
from msgpatterns.headers import FIRST_FAILED_AT
from msgpatterns.testing import services

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


class AsyncHarness:
    """One async broker kind, one topic and group on one server."""

    name = "?"
    counts_crash_redeliveries = True
    crash_window = 5.0
    quiet = 1.0

    def __init__(self) -> None:
        unique = uuid.uuid4().hex[:10]
        self.topic = f"aconf-{unique}"
        self.group = f"agroup-{unique}"
        self.brokers: list[Any] = []

    async def broker(self) -> Any:
        """A new broker object on the same server (a restarted consumer process)."""
        broker = self._make()
        self.brokers.append(broker)
        await broker.subscribe(self.topic, self.group)
        return broker

    def _make(self) -> Any:
        raise NotImplementedError

    async def crash(self, broker: Any) -> None:
        """The process holding ``broker`` dies: no ack, no goodbye."""

    async def close(self, broker: Any) -> None:
        await broker.close()

    def sync_broker(self) -> Any:
        """The sync adapter on the same server."""
        raise NotImplementedError

    def close_sync(self, broker: Any) -> None:
        broker.close()

    def dead_letters(self) -> list[DeadLetter]:
        raise NotImplementedError

    async def cleanup(self) -> None:
        for broker in self.brokers:
            with contextlib.suppress(Exception):
                await broker.close()


class MemoryHarness(AsyncHarness):
    name = "memory"
    quiet = 0.2

    def __init__(self) -> None:
        super().__init__()
        self.shared = AsyncInMemoryBroker(visibility_timeout=30.0)

    def _make(self) -> Any:
        return self.shared

    async def crash(self, broker: Any) -> None:
        self.shared.advance(31.0)

    async def close(self, broker: Any) -> None:
        pass  # closing the fake ends it for everyone

    def sync_broker(self) -> Any:
        return self.shared.sync

    def close_sync(self, broker: Any) -> None:
        pass  # the shared fake

    def dead_letters(self) -> list[DeadLetter]:
        return self.shared.dead_letters

    async def cleanup(self) -> None:
        await self.shared.close()


class RedisHarness(AsyncHarness):
    name = "redis"
    quiet = 1.5

    def __init__(self) -> None:
        require_library("redis", "AsyncRedisStreamsBroker")
        super().__init__()
        import redis

        self.url = services.require("redis")
        self.client = redis.Redis.from_url(self.url)

    def _make(self) -> Any:
        from msgpatterns.aio.redis_streams import AsyncRedisStreamsBroker

        return AsyncRedisStreamsBroker(self.url, visibility_timeout=1.0, claim_interval=0.1)

    def sync_broker(self) -> Any:
        from msgpatterns.brokers import RedisStreamsBroker

        broker = RedisStreamsBroker(self.client, visibility_timeout=1.0, claim_interval=0.1,
                                    ack_flush_interval=0)
        self.brokers.append(broker)
        return broker

    async def crash(self, broker: Any) -> None:
        self.brokers.remove(broker)  # never closed: its deliveries stay pending
        await broker._redis.aclose()

    def dead_letters(self) -> list[DeadLetter]:
        from msgpatterns.brokers import RedisStreamsBroker

        admin = RedisStreamsBroker(self.client)
        return admin.list_dead_letters(self.topic, self.group)

    async def cleanup(self) -> None:
        for broker in self.brokers:
            with contextlib.suppress(Exception):
                result = broker.close()
                if asyncio.iscoroutine(result):
                    await result
        t, g = self.topic, self.group  # named, not scanned: the shared db is large
        self.client.delete(t, f"{t}:retry:{g}", f"{t}:delayed:{g}", f"{t}:dlq")
        self.client.close()


class RabbitMQHarness(AsyncHarness):
    name = "rabbitmq"
    crash_window = 3.0
    quiet = 0.5  # unacked deliveries go back the moment their connection closes

    def __init__(self) -> None:
        require_library("aio_pika", "AsyncRabbitMQBroker")
        require_library("pika", "AsyncRabbitMQBroker")
        super().__init__()
        self.url = services.require("rabbitmq")

    def _make(self) -> Any:
        from msgpatterns.aio.rabbitmq import AsyncRabbitMQBroker

        return AsyncRabbitMQBroker(self.url, prefetch=50)

    def sync_broker(self) -> Any:
        from msgpatterns.brokers import RabbitMQBroker

        broker = RabbitMQBroker(self.url, prefetch=50)
        self.brokers.append(broker)
        return broker

    async def crash(self, broker: Any) -> None:
        broker._closed = True  # dies: nothing handed back, nothing acked
        await broker._connection.close()

    def dead_letters(self) -> list[DeadLetter]:
        from msgpatterns.brokers import RabbitMQBroker

        with RabbitMQBroker(self.url) as admin:
            return admin.list_dead_letters(self.topic, self.group)

    async def cleanup(self) -> None:
        for broker in self.brokers:
            with contextlib.suppress(Exception):
                result = broker.close()
                if asyncio.iscoroutine(result):
                    await result
        delete_rabbitmq_topology(self.url, self.topic, self.group)


class KafkaHarness(AsyncHarness):
    name = "kafka"
    counts_crash_redeliveries = False  # Kafka keeps no delivery count
    quiet = 2.0

    def __init__(self) -> None:
        self.cluster = kafka_cluster()
        super().__init__()

    def _make(self) -> Any:
        from msgpatterns.aio.kafka import ThreadedAsyncKafkaBroker

        return ThreadedAsyncKafkaBroker(self.cluster.bootstrap_servers,
                                        consumer_config=KAFKA_TEST_CONSUMER)

    def sync_broker(self) -> Any:
        from msgpatterns.brokers import KafkaBroker

        broker = KafkaBroker(self.cluster.bootstrap_servers,
                             consumer_config=KAFKA_TEST_CONSUMER)
        self.brokers.append(broker)
        return broker

    async def crash(self, broker: Any) -> None:
        # Gone without committing (a killed process); leaving the group lets the next
        # consumer in at once.
        for state in broker.sync._groups.values():
            state.consumer.close()
        broker.sync._groups.clear()

    def dead_letters(self) -> list[DeadLetter]:
        from msgpatterns.brokers import KafkaBroker

        with KafkaBroker(self.cluster.bootstrap_servers,
                         consumer_config=KAFKA_TEST_CONSUMER) as admin:
            return admin.list_dead_letters(self.topic, self.group)

    async def cleanup(self) -> None:
        for broker in self.brokers:
            with contextlib.suppress(Exception):
                result = broker.close()
                if asyncio.iscoroutine(result):
                    await result


class NatsHarness(AsyncHarness):
    """NATS JetStream on nats-py's asyncio client, natively (no thread)."""

    name = "nats"
    crash_window = 3.0  # the visibility timeout (ack_wait) plus a fetch
    quiet = 1.5

    def __init__(self) -> None:
        require_library("nats", "AsyncNatsJetStreamBroker")
        super().__init__()
        self.url = services.require("nats")

    def _make(self) -> Any:
        from msgpatterns.aio import AsyncNatsJetStreamBroker

        return AsyncNatsJetStreamBroker(self.url, visibility_timeout=1.0)

    def sync_broker(self) -> Any:
        from msgpatterns.brokers import NatsJetStreamBroker

        broker = NatsJetStreamBroker(self.url, visibility_timeout=1.0)
        self.brokers.append(broker)
        return broker

    async def crash(self, broker: Any) -> None:
        broker._closed = True  # dies: nothing handed back, nothing acked
        await broker._nc.close()

    def dead_letters(self) -> list[DeadLetter]:
        from msgpatterns.brokers import NatsJetStreamBroker

        with NatsJetStreamBroker(self.url) as broker:
            return broker.dead_letter_admin().list_dead_letters(self.topic, self.group)

    async def cleanup(self) -> None:
        for broker in self.brokers:
            with contextlib.suppress(Exception):
                result = broker.close()
                if asyncio.iscoroutine(result):
                    await result
        await asyncio.to_thread(delete_nats_stream, self.url, self.topic)


class AIOKafkaHarness(KafkaHarness):
    """Kafka on aiokafka (no threads), against the same mock cluster and topics."""

    name = "kafka-aiokafka"
    crash_window = 8.0  # a classic-protocol group waits 3 s per (re)join on the mock

    def __init__(self) -> None:
        require_library("aiokafka", "AIOKafkaBroker")
        super().__init__()

    def _make(self) -> Any:
        from msgpatterns.aio.kafka_native import AIOKafkaBroker

        return AIOKafkaBroker(self.cluster.bootstrap_servers,
                              consumer_config=AIOKAFKA_TEST_CONSUMER)

    def sync_broker(self) -> Any:
        # One group, one group protocol and one assignor: aiokafka speaks the classic
        # protocol (librdkafka's default) with the round-robin assignor; the mock
        # cluster mixes neither KIP-848 members nor assignors (it aborts).
        from msgpatterns.brokers import KafkaBroker

        classic = {**KAFKA_TEST_CONSUMER, "group.protocol": "classic",
                   "partition.assignment.strategy": "roundrobin",
                   "session.timeout.ms": 4000, "heartbeat.interval.ms": 1000}
        broker = KafkaBroker(self.cluster.bootstrap_servers, consumer_config=classic)
        self.brokers.append(broker)
        return broker

    async def crash(self, broker: Any) -> None:
        # Gone without committing: the consumers leave their groups, nothing commits.
        for state in broker._groups.values():
            await state.consumer.stop()
        broker._groups.clear()


#: aiokafka consumer settings for tests: short fetch waits, like KAFKA_TEST_CONSUMER.
AIOKAFKA_TEST_CONSUMER = {"fetch_max_wait_ms": 50, "session_timeout_ms": 4000,
                          "heartbeat_interval_ms": 1000}

HARNESSES: dict[str, Callable[[], AsyncHarness]] = {
    "memory": MemoryHarness, "redis": RedisHarness, "rabbitmq": RabbitMQHarness,
    "kafka": KafkaHarness, "kafka-aiokafka": AIOKafkaHarness, "nats": NatsHarness,
}


@pytest.fixture(params=[pytest.param("memory", id="memory"),
                        pytest.param("redis", id="redis", marks=pytest.mark.redis),
                        pytest.param("rabbitmq", id="rabbitmq", marks=pytest.mark.rabbitmq),
                        pytest.param("kafka", id="kafka", marks=pytest.mark.kafka),
                        pytest.param("nats", id="nats", marks=pytest.mark.nats),
                        pytest.param("kafka-aiokafka", id="kafka-aiokafka",
                                     marks=pytest.mark.kafka)])
async def h(request: pytest.FixtureRequest) -> AsyncIterator[AsyncHarness]:
    harness = HARNESSES[request.param]()
    try:
        yield harness
    finally:
        await harness.cleanup()


async def drain(broker: Any, topic: str, group: str, *, count: int | None = None,
                within: float = 10.0, batch: int = 10) -> list[Message]:
    """Fetch until ``count`` deliveries arrived (or, with None, for ``within`` s)."""
    got: list[Message] = []
    give_up = time.monotonic() + within
    while count is None or len(got) < count:
        left = give_up - time.monotonic()
        if left <= 0:
            break
        want = batch if count is None else min(batch, count - len(got))
        got.extend(await broker.fetch([topic], group, max_messages=want,
                                      timeout=min(left, 0.1)))
    return got


async def test_publish_fetch_ack(h: AsyncHarness) -> None:
    broker = await h.broker()
    ids = [await broker.publish(h.topic, f"m{i}".encode(), key=f"k{i}",
                                headers={"n": str(i)}) for i in range(3)]
    got = await drain(broker, h.topic, h.group, count=3)
    assert sorted(m.raw_body for m in got) == [b"m0", b"m1", b"m2"]
    for m in got:
        i = int(m.raw_body[1:])
        assert (m.topic, m.key, m.headers.get("n"), m.attempt) == (h.topic, f"k{i}", str(i), 1)
        assert m.id == ids[i]
        await broker.ack(m)
    await h.close(broker)
    again = await h.broker()
    assert await drain(again, h.topic, h.group, within=h.quiet) == []


async def test_nack_delay_is_honoured_with_original_payload_and_current_headers(
        h: AsyncHarness) -> None:
    broker = await h.broker()
    await broker.publish(h.topic, b'{"n": 1}', key="k")
    [first] = await drain(broker, h.topic, h.group, count=1)
    first.body = {"decoded": "by a decoder"}  # the retry must carry raw_body
    first.headers[FIRST_FAILED_AT] = "123.0"
    first.headers["x-note"] = "failed once"
    nacked_at = time.monotonic()
    await broker.nack(first, 0.6)
    [retry] = await drain(broker, h.topic, h.group, count=1, within=15)
    if h.name != "memory":  # the fake's delays are on its virtual clock
        assert time.monotonic() - nacked_at >= 0.6 - 0.02
    assert retry.raw_body == b'{"n": 1}'
    assert retry.attempt == 2
    assert retry.id == first.id and retry.key == "k" and retry.topic == h.topic
    assert retry.headers["x-note"] == "failed once"
    assert retry.headers[FIRST_FAILED_AT] == "123.0"
    await broker.ack(retry)


async def test_attempt_count_survives_redelivery_restart_and_crash(h: AsyncHarness) -> None:
    b1 = await h.broker()
    await b1.publish(h.topic, b"payload")
    [m1] = await drain(b1, h.topic, h.group, count=1)
    assert m1.attempt == 1
    await b1.nack(m1, 0.0)
    await h.close(b1)

    b2 = await h.broker()  # a restarted consumer
    [m2] = await drain(b2, h.topic, h.group, count=1)
    assert m2.attempt == 2
    await b2.nack(m2, 0.2)
    await h.close(b2)

    b3 = await h.broker()
    [m3] = await drain(b3, h.topic, h.group, count=1)
    assert m3.attempt == 3
    await h.crash(b3)  # dies holding the delivery

    b4 = await h.broker()
    [m4] = await drain(b4, h.topic, h.group, count=1, within=h.crash_window + 5)
    assert m4.raw_body == b"payload"
    assert m4.attempt == (4 if h.counts_crash_redeliveries else 3)
    await b4.ack(m4)


async def test_sync_and_async_adapters_read_each_others_retries(h: AsyncHarness) -> None:
    sync = h.sync_broker()
    if not h.name.startswith("kafka"):
        # Push brokers need the group's queue before the publish. A Kafka group reads
        # from the earliest offset anyway, and closing a consumer still joining its
        # group can stall librdkafka's close on the mock cluster (seen with the
        # classic protocol): the test is about retries, not that.
        sync.subscribe(h.topic, h.group)
    sync.publish(h.topic, b"x", key="k", headers={"origin": "sync"})
    h.close_sync(sync)  # one consumer at a time: push brokers prefetch
    broker = await h.broker()
    [first] = await drain(broker, h.topic, h.group, count=1)
    first.headers["x-note"] = "async failed"
    await broker.nack(first, 0.5)  # off the wire while the broker closes (see the
    await h.close(broker)          # sync conformance test of attempt counts)
    sync = h.sync_broker()
    [second] = sync_drain(sync, h.topic, h.group, count=1)
    assert (second.attempt, second.key, second.headers["x-note"]) == (2, "k", "async failed")
    second.headers["x-note"] = "sync failed"
    sync.nack(second, 0.5)
    h.close_sync(sync)
    again = await h.broker()
    [third] = await drain(again, h.topic, h.group, count=1)
    assert (third.attempt, third.id, third.headers["origin"]) == (3, first.id, "sync")
    assert third.headers["x-note"] == "sync failed"
    await again.ack(third)


async def _consume(consumer: AsyncConsumer, done: asyncio.Event, timeout: float = 20) -> None:
    async with consumer:
        await asyncio.wait_for(done.wait(), timeout)


async def test_max_attempts_dead_letters_the_full_record(h: AsyncHarness) -> None:
    broker = await h.broker()
    done: list[bytes] = []
    finished = asyncio.Event()

    async def handler(message: Message) -> None:
        if message.raw_body == b"poison":
            if message.attempt == 3:
                asyncio.get_running_loop().call_later(0.05, finished.set)
            raise ValueError(f"boom on attempt {message.attempt}")
        done.append(message.raw_body)

    await broker.publish(h.topic, b"poison", key="bad", headers={"origin": "test"})
    await broker.publish(h.topic, b"fine")
    consumer = AsyncConsumer(
        broker, handler, topics=[h.topic], group=h.group, poll_timeout=0.05,
        retry=RetryPolicy(max_attempts=3, backoff=Backoff.fixed(0.05), local_retries=0))
    if h.name == "memory":
        await consumer.run_until_idle(timeout=20)
    else:
        await _consume(consumer, finished)
    [record] = h.dead_letters()
    assert record.attempts == 3
    assert record.error_type.endswith("ValueError")
    assert record.error_message == "boom on attempt 3"
    assert "ValueError: boom on attempt 3" in record.traceback
    assert record.reason.startswith("gave up after 3 attempts")
    assert record.first_failed_at <= record.last_failed_at
    assert record.message.raw_body == b"poison"
    assert record.message.key == "bad" and record.message.topic == h.topic
    assert record.message.headers["origin"] == "test"
    assert record.group == h.group
    assert done == [b"fine"]


async def test_undecodable_body_is_dead_lettered_and_the_consumer_keeps_going(
        h: AsyncHarness) -> None:
    broker = await h.broker()
    decoded: list[Any] = []
    two = asyncio.Event()
    await broker.publish(h.topic, b"{not json")
    await broker.publish(h.topic, b'{"ok": 1}')

    async def handler(message: Message) -> None:
        decoded.append(message.body)
        if len(decoded) == 2:
            two.set()

    async def decode(raw: bytes) -> Any:
        return json.loads(raw)

    consumer = AsyncConsumer(broker, handler, topics=[h.topic], group=h.group,
                             decoder=decode, poll_timeout=0.05)
    async with consumer:
        await broker.publish(h.topic, b'{"ok": 2}')  # consumed after the bad one
        await asyncio.wait_for(two.wait(), 20)
    [record] = h.dead_letters()
    assert record.message.raw_body == b"{not json"
    assert "cannot decode body" in record.reason
    assert record.error_type.endswith("MalformedMessage")
    assert record.attempts == 1
    assert sorted(d["ok"] for d in decoded) == [1, 2]


async def test_max_in_flight_is_respected(h: AsyncHarness) -> None:
    broker = await h.broker()
    total, limit = 20, 3
    for i in range(total):
        await broker.publish(h.topic, str(i).encode())
    held: set[bytes] = set()
    finished: set[bytes] = set()
    peak = 0
    all_done = asyncio.Event()

    def settle_later(message: Message) -> None:
        held.discard(message.raw_body)
        finished.add(message.raw_body)
        message.ack()
        if len(finished) == total:
            all_done.set()

    async def handler(message: Message) -> None:
        nonlocal peak
        message.disable_auto_ack()
        held.add(message.raw_body)
        peak = max(peak, len(held))
        asyncio.get_running_loop().call_later(0.01, settle_later, message)

    consumer = AsyncConsumer(broker, handler, topics=[h.topic], group=h.group,
                             max_in_flight=limit, fetch_batch=10, poll_timeout=0.05)
    await _consume(consumer, all_done)
    assert 1 <= peak <= limit
