"""AsyncRabbitMQBroker specifics on the real RabbitMQ: a delivery with a bad attempt
header is dead-lettered on its own; a publish nothing would keep is refused; a closed
broker refuses everything."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from broker_harness import delete_rabbitmq_topology
from msgpatterns import headers as h
from msgpatterns.brokers import RabbitMQBroker
from msgpatterns.errors import BrokerClosed, UnroutableError

pytestmark = [pytest.mark.anyio, pytest.mark.rabbitmq, pytest.mark.timeout(30)]

pika = pytest.importorskip("pika")
pytest.importorskip("aio_pika")


@pytest.fixture
def names(rabbitmq_url: str, unique: str) -> Iterator[tuple[str, str]]:
    topic, group = f"arabbit-{unique}", f"g-{unique}"
    yield topic, group
    delete_rabbitmq_topology(rabbitmq_url, topic, group)


async def test_a_bad_attempt_header_is_dead_lettered_and_the_rest_delivered(
        rabbitmq_url: str, names: tuple[str, str]) -> None:
    from msgpatterns.aio.rabbitmq import AsyncRabbitMQBroker

    topic, group = names
    async with AsyncRabbitMQBroker(rabbitmq_url) as broker:
        await broker.subscribe(topic, group)
        foreign = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
        channel = foreign.channel()
        channel.basic_publish(topic, topic, b"bad", pika.BasicProperties(
            headers={h.ATTEMPT: "zero"}, message_id="bad-1"))
        channel.basic_publish(topic, topic, b"good")
        foreign.close()
        got = []
        while not got:
            got = await broker.fetch([topic], group, max_messages=10, timeout=2)
        assert [m.raw_body for m in got] == [b"good"]
        await broker.ack(got[0])
    with RabbitMQBroker(rabbitmq_url) as admin:
        [record] = admin.list_dead_letters(topic, group)
    assert record.message.raw_body == b"bad" and h.ATTEMPT in record.reason


async def test_publish_to_a_topic_nobody_subscribed_is_unroutable(
        rabbitmq_url: str, names: tuple[str, str]) -> None:
    from msgpatterns.aio.rabbitmq import AsyncRabbitMQBroker

    topic, group = names
    async with AsyncRabbitMQBroker(rabbitmq_url) as broker:
        with pytest.raises(UnroutableError):
            await broker.publish(topic, b"lost?")
        await broker.subscribe(topic, group)  # the broker still works afterwards
        assert await broker.publish(topic, b"kept")


async def test_a_closed_broker_refuses_every_operation(rabbitmq_url: str,
                                                      names: tuple[str, str]) -> None:
    from msgpatterns.aio.rabbitmq import AsyncRabbitMQBroker

    topic, group = names
    broker = AsyncRabbitMQBroker(rabbitmq_url)
    await broker.subscribe(topic, group)
    await broker.close()
    await broker.close()  # idempotent
    with pytest.raises(BrokerClosed):
        await broker.fetch([topic], group)
    with pytest.raises(BrokerClosed):
        await broker.publish(topic, b"y")


async def test_batched_acks_never_cover_a_held_delivery_or_a_hand_back(
        rabbitmq_url: str, names: tuple[str, str]) -> None:
    """Eight deliveries acked out of order, all in one loop turn (one batched flush),
    with the 3rd held and the 5th handed back by a refused nack delay: the server
    (rabbitmqctl) shows exactly the held one unacknowledged; the handed-back one comes
    back once; close() returns the held one to the queue."""
    import asyncio
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "regressions"))
    from test_rabbitmq import settled_on_server

    from msgpatterns.aio.rabbitmq import AsyncRabbitMQBroker
    from msgpatterns.errors import ConfigurationError

    topic, group = names
    broker = AsyncRabbitMQBroker(rabbitmq_url, prefetch=20)
    await broker.subscribe(topic, group)
    queue = broker.queue_name(topic, group)
    for i in range(8):
        await broker.publish(topic, f"m{i}".encode())
    got: list = []
    while len(got) < 8:
        got += await broker.fetch([topic], group, max_messages=8 - len(got), timeout=2)
    assert [m.raw_body for m in got] == [f"m{i}".encode() for i in range(8)]
    with pytest.raises(ConfigurationError):
        await broker.nack(got[4], -1.0)
    await asyncio.gather(*(broker.ack(m) for m in reversed(got) if m not in (got[2], got[4])))
    [back] = await broker.fetch([topic], group, max_messages=5, timeout=5)
    assert back.raw_body == b"m4"
    await broker.ack(back)
    await asyncio.to_thread(settled_on_server, topic, {queue: (0, 1)})
    await broker.close()
    await asyncio.to_thread(settled_on_server, topic, {queue: (1, 0)})
