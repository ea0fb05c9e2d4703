"""AsyncRedisStreamsBroker specifics on the real Redis: foreign entries that cannot be
decoded are dead-lettered on their own, and a closed broker refuses everything."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from msgpatterns.brokers import RedisStreamsBroker
from msgpatterns.errors import BrokerClosed

pytestmark = [pytest.mark.anyio, pytest.mark.redis, pytest.mark.timeout(30)]

redis = pytest.importorskip("redis")


@pytest.fixture
def names(redis_url: str, unique: str) -> Iterator[tuple[str, str]]:
    topic, group = f"aredis-{unique}", f"g-{unique}"
    yield topic, group
    client = redis.Redis.from_url(redis_url)
    client.delete(topic, f"{topic}:retry:{group}", f"{topic}:delayed:{group}",
                  f"{topic}:dlq")
    client.close()


async def test_an_undecodable_entry_is_dead_lettered_and_the_rest_delivered(
        redis_url: str, names: tuple[str, str]) -> None:
    from msgpatterns.aio.redis_streams import AsyncRedisStreamsBroker

    topic, group = names
    foreign = redis.Redis.from_url(redis_url)
    async with AsyncRedisStreamsBroker(redis_url) as broker:
        await broker.subscribe(topic, group)
        foreign.xadd(topic, {"body": b"bad", "headers": b"not json"})
        foreign.xadd(topic, {"body": b"good"})
        got = await broker.fetch([topic], group, max_messages=10, timeout=1)
        assert [m.raw_body for m in got] == [b"good"]
        await broker.ack(got[0])
    [record] = RedisStreamsBroker(foreign).list_dead_letters(topic, group)
    assert "undecodable Redis stream entry" in record.reason
    assert record.error_type.endswith("MalformedMessage")
    assert foreign.xpending(topic, group)["pending"] == 0
    foreign.close()


async def test_a_closed_broker_refuses_every_operation(redis_url: str,
                                                      names: tuple[str, str]) -> None:
    from msgpatterns.aio.redis_streams import AsyncRedisStreamsBroker

    topic, group = names
    broker = AsyncRedisStreamsBroker(redis_url)
    await broker.publish(topic, b"x")
    await broker.close()
    await broker.close()  # idempotent
    with pytest.raises(BrokerClosed):
        await broker.fetch([topic], group)
    with pytest.raises(BrokerClosed):
        await broker.publish(topic, b"y")
