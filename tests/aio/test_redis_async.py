"""AsyncRedisStreamsBroker specifics on the real Redis: foreign entries that cannot be
decoded are dead-lettered on their own, and a closed broker refuses everything."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from msgpatterns.brokers import RedisStreamsBroker
from msgpatterns.errors import BrokerClosed

if TYPE_CHECKING:
    from msgpatterns.brokers.redis.aio import AsyncRedisStreamsBroker

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


@pytest.fixture
def two_topics(redis_url: str, unique: str) -> Iterator[tuple[str, str, str]]:
    a, b, group = f"aredis-a-{unique}", f"aredis-b-{unique}", f"g-{unique}"
    yield a, b, group
    client = redis.Redis.from_url(redis_url)
    for topic in (a, b):
        client.delete(topic, f"{topic}:retry:{group}", f"{topic}:delayed:{group}",
                      f"{topic}:dlq")
    client.close()


async def _retry_stream_of(broker: AsyncRedisStreamsBroker, topic: str, group: str,
                           count: int) -> None:
    """``count`` entries of ``topic`` read and nacked: they wait, unread, in its retry
    stream (the oldest messages of their key)."""
    got = await broker.fetch([topic], group, max_messages=count, timeout=1)
    assert len(got) == count
    for message in got:
        await broker.nack(message)


async def test_a_multi_stream_reads_surplus_keeps_its_place_before_older_retries(
        redis_url: str, two_topics: tuple[str, str, str]) -> None:
    """Regression: a read over several streams gets up to COUNT entries from each; the
    surplus of a retry stream was handed back behind the same stream's unread retries
    (q1, q2 after q3..q5 of the same key). Kept and served first, the key's order holds."""
    from msgpatterns.aio.redis_streams import AsyncRedisStreamsBroker

    a, b, group = two_topics
    async with AsyncRedisStreamsBroker(redis_url) as broker:
        await broker.subscribe(a, group)
        await broker.subscribe(b, group)
        for i in range(1, 6):
            await broker.publish(b, f"q{i}".encode(), key="q")
        await _retry_stream_of(broker, b, group, 5)
        for i in range(1, 3):
            await broker.publish(a, f"a{i}".encode(), key="a")
        first = await broker.fetch([a, b], group, max_messages=2, timeout=1)
        assert [m.raw_body for m in first] == [b"a1", b"a2"]  # q1, q2 were read too
        seen: list[bytes] = []
        for _ in range(10):
            got = await broker.fetch([a, b], group, max_messages=2, timeout=0.2)
            seen.extend(m.raw_body for m in got)
            for message in got:
                await broker.ack(message)
            if len(seen) >= 5:
                break
        assert seen == [b"q1", b"q2", b"q3", b"q4", b"q5"]


async def test_the_surplus_of_a_stream_no_longer_asked_for_is_handed_back_at_once(
        redis_url: str, two_topics: tuple[str, str, str]) -> None:
    """A fetch that no longer asks for a stream (a partition handed over) hands back
    the surplus it held of that stream at once, in order: another consumer reads it
    without waiting for ``visibility_timeout``."""
    from msgpatterns.aio.redis_streams import AsyncRedisStreamsBroker

    a, b, group = two_topics
    async with AsyncRedisStreamsBroker(redis_url) as first, \
            AsyncRedisStreamsBroker(redis_url) as second:
        await first.subscribe(a, group)
        await first.subscribe(b, group)
        for i in range(1, 4):
            await first.publish(b, f"b{i}".encode(), key="b")
        await first.publish(a, b"a1", key="a")
        got = await first.fetch([a, b], group, max_messages=1, timeout=1)
        assert [m.raw_body for m in got] == [b"a1"]  # b1..b3 read too: the surplus
        assert await first.fetch([a], group, max_messages=10, timeout=0) == []
        taken = await second.fetch([b], group, max_messages=10, timeout=1)
        assert [m.raw_body for m in taken] == [b"b1", b"b2", b"b3"]
        assert [m.attempt for m in taken] == [1, 1, 1]  # handed back, not retried
