"""Dead letters written by async consumers are managed by the same admin and the same
``msgpatterns dlq`` command as the sync ones (issue 12): an AsyncConsumer dead-letters,
the async adapter's ``dead_letter_admin()`` (awaited through ``AsyncDeadLetters``) and
the CLI list and replay it, and a sync consumer and an async consumer then process the
replays, attempts reset. Real servers (Kafka: librdkafka's mock cluster)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from broker_harness import (
    KAFKA_TEST_CONSUMER,
    delete_rabbitmq_topology,
    drain,
    kafka_cluster,
    require_library,
)
from msgpatterns import Message, Reject
from msgpatterns.aio import AsyncConsumer, AsyncDeadLetters
from msgpatterns.brokers import DeadLetterAdmin
from msgpatterns.cli import main
from msgpatterns.errors import BrokerClosed
from msgpatterns.testing import services

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

#: aiokafka consumer settings for tests: short fetch waits, like KAFKA_TEST_CONSUMER.
AIOKAFKA_TEST_CONSUMER = {"fetch_max_wait_ms": 50, "session_timeout_ms": 4000,
                          "heartbeat_interval_ms": 1000}


@dataclass
class Setup:
    kind: str
    url: str
    topic: str = field(default_factory=lambda: f"adlq-{uuid.uuid4().hex[:10]}")
    group: str = field(default_factory=lambda: f"g-{uuid.uuid4().hex[:10]}")
    opened: list[Any] = field(default_factory=list)

    def async_broker(self) -> Any:
        if self.kind == "redis":
            from msgpatterns.aio.redis_streams import AsyncRedisStreamsBroker
            broker: Any = AsyncRedisStreamsBroker(self.url)
        elif self.kind == "rabbitmq":
            from msgpatterns.aio.rabbitmq import AsyncRabbitMQBroker
            broker = AsyncRabbitMQBroker(self.url)
        elif self.kind == "kafka":
            from msgpatterns.aio.kafka import ThreadedAsyncKafkaBroker
            broker = ThreadedAsyncKafkaBroker(self.url, consumer_config=KAFKA_TEST_CONSUMER)
        else:
            from msgpatterns.aio.kafka import AsyncKafkaBroker  # aiokafka
            broker = AsyncKafkaBroker(self.url, consumer_config=AIOKAFKA_TEST_CONSUMER)
        self.opened.append(broker)
        return broker

    def sync_broker(self) -> Any:
        from msgpatterns.brokers import KafkaBroker, RabbitMQBroker, RedisStreamsBroker

        broker: Any
        if self.kind == "redis":
            broker = RedisStreamsBroker(self.url, ack_flush_interval=0)
        elif self.kind == "rabbitmq":
            broker = RabbitMQBroker(self.url)
        elif self.kind == "kafka":
            broker = KafkaBroker(self.url, consumer_config=KAFKA_TEST_CONSUMER)
        else:  # sharing a group with aiokafka: its protocol and assignor (the mock
            # cluster mixes neither)
            broker = KafkaBroker(self.url, consumer_config={
                **KAFKA_TEST_CONSUMER, "group.protocol": "classic",
                "partition.assignment.strategy": "roundrobin",
                "session.timeout.ms": 4000, "heartbeat.interval.ms": 1000})
        self.opened.append(broker)
        return broker

    def dlq(self, *args: str) -> int:
        return main(["dlq", args[0], self.cli_url, "--topic", self.topic, "--group",
                     self.group, *args[1:]])

    @property
    def cli_url(self) -> str:
        return f"kafka://{self.url}" if self.kind.startswith("kafka") else self.url


@pytest.fixture(params=[pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
                        pytest.param("kafka", marks=pytest.mark.kafka),
                        pytest.param("kafka-aiokafka", marks=pytest.mark.kafka)])
async def setup(request: pytest.FixtureRequest) -> AsyncIterator[Setup]:
    kind = request.param
    if kind.startswith("kafka"):
        if kind == "kafka-aiokafka":
            require_library("aiokafka", "AIOKafkaBroker")
        url = kafka_cluster().bootstrap_servers
    else:
        require_library("aio_pika" if kind == "rabbitmq" else "redis", kind)
        url = services.require(kind)
    s = Setup(kind, url)
    try:
        yield s
    finally:
        for broker in reversed(s.opened):
            with contextlib.suppress(Exception):
                result = broker.close()
                if asyncio.iscoroutine(result):
                    await result
        if kind == "redis":
            import redis

            client = redis.Redis.from_url(url)
            t, g = s.topic, s.group
            client.delete(t, f"{t}:retry:{g}", f"{t}:delayed:{g}", f"{t}:dlq")
            client.close()
        elif kind == "rabbitmq":
            delete_rabbitmq_topology(url, s.topic, s.group)


async def test_async_dead_letters_are_listed_and_replayed_by_the_cli(
        setup: Setup, capsys: pytest.CaptureFixture[str]) -> None:
    broker = setup.async_broker()
    await broker.subscribe(setup.topic, setup.group)
    first = await broker.publish(setup.topic, b"first", key="k1", headers={"trace": "t1"})
    second = await broker.publish(setup.topic, b"second", key="k2")

    async def reject(message: Message) -> None:
        raise Reject(f"cannot handle {message.raw_body.decode()}")

    admin = AsyncDeadLetters(broker.dead_letter_admin())
    assert isinstance(admin.sync, DeadLetterAdmin)
    async with AsyncConsumer(broker, reject, topics=[setup.topic], group=setup.group,
                             poll_timeout=0.05):
        for _ in range(400):
            if len(await admin.list_dead_letters(setup.topic, setup.group)) == 2:
                break
            await asyncio.sleep(0.05)
    records = await admin.list_dead_letters(setup.topic, setup.group)
    assert sorted(r.id for r in records) == sorted([first, second])
    assert all(r.group == setup.group and r.error_type.endswith("Reject") for r in records)
    assert await admin.knows(setup.topic, setup.group)
    await broker.close()  # its consumers leave: the replays go to the next consumer
    with pytest.raises(BrokerClosed):  # the admin of a closed adapter refuses at once
        await admin.list_dead_letters(setup.topic, setup.group)
    admin = AsyncDeadLetters(setup.async_broker().dead_letter_admin())  # never consumes

    # the command sees the async consumer's dead letters ...
    assert await asyncio.to_thread(setup.dlq, "list") == 0
    out = capsys.readouterr().out
    assert first in out and second in out and "2 dead letter(s)" in out
    assert "cannot handle first" in out
    # ... and replays one: a sync consumer processes it, attempts reset
    assert await asyncio.to_thread(setup.dlq, "replay", first) == 0
    assert "replayed 1" in capsys.readouterr().out
    sync = await asyncio.to_thread(setup.sync_broker)
    [back] = await asyncio.to_thread(drain, sync, setup.topic, setup.group, count=1,
                                     within=20)
    assert (back.raw_body, back.id, back.key, back.attempt) == (b"first", first, "k1", 1)
    assert back.headers.get("trace") == "t1"
    await asyncio.to_thread(sync.ack, back)
    await asyncio.to_thread(sync.close)

    # the other is replayed through the async admin and an async consumer processes it
    assert await admin.replay_dead_letters(setup.topic, setup.group, ids=[second]) == 1
    seen: list[Message] = []
    done = asyncio.Event()

    async def record(message: Message) -> None:
        seen.append(message)
        done.set()

    again = setup.async_broker()
    async with AsyncConsumer(again, record, topics=[setup.topic], group=setup.group,
                             poll_timeout=0.05):
        await asyncio.wait_for(done.wait(), 30)
    assert [(m.raw_body, m.id, m.attempt) for m in seen] == [(b"second", second, 1)]
    assert await admin.list_dead_letters(setup.topic, setup.group) == []
    await admin.close()


@pytest.mark.redis
async def test_the_admin_of_an_adapter_built_on_a_client_reaches_the_same_server(
        redis_url: str, unique: str) -> None:
    """Given a ``redis.asyncio`` client, the admin opens a sync client to the same server
    (and database) and closes it again; the caller's client stays open."""
    aioredis = pytest.importorskip("redis.asyncio")
    from msgpatterns.aio.redis_streams import AsyncRedisStreamsBroker

    client = aioredis.Redis.from_url(redis_url)
    topic = f"aclient-{unique}"
    async with AsyncRedisStreamsBroker(client) as broker:
        await broker.publish(topic, b"x")
        admin = broker.dead_letter_admin()
        try:
            assert await asyncio.to_thread(admin.knows, topic)
            assert not await asyncio.to_thread(admin.knows, f"{topic}-none")
        finally:
            admin.close()
    assert await client.ping()
    await client.delete(topic)
    await client.aclose()
