"""The plugin's async fixtures: async_fake_broker (with the marker's fault injection)
and aconsume (an AsyncConsumer until idle on virtual time) - issue 12 item 5."""

from __future__ import annotations

import pytest

from msgpatterns import Backoff, Message, RetryPolicy
from msgpatterns.aio import AsyncInMemoryBroker
from msgpatterns.testing.aio_fixtures import AConsumeFn

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


async def test_aconsume_runs_an_async_handler_until_idle(
        async_fake_broker: AsyncInMemoryBroker, aconsume: AConsumeFn) -> None:
    await async_fake_broker.publish("test", b"a")
    await async_fake_broker.publish("test", b"b")
    seen: list[tuple[bytes, int]] = []

    async def handler(message: Message) -> None:
        seen.append((message.raw_body, message.attempt))
        if message.raw_body == b"b" and message.attempt == 1:
            raise ValueError("first try")

    consumer = await aconsume(handler, retry=RetryPolicy(backoff=Backoff.fixed(3600)))
    assert sorted(seen) == [(b"a", 1), (b"b", 1), (b"b", 2)]  # an hour, on virtual time
    assert consumer.stats.acked == 2 and async_fake_broker.pending == 0


@pytest.mark.msgpatterns(duplicate_rate=0.5, lost_ack_rate=0.3, seed=3)
async def test_the_marker_injects_faults_into_the_async_fake(
        async_fake_broker: AsyncInMemoryBroker, aconsume: AConsumeFn) -> None:
    for i in range(40):
        await async_fake_broker.publish("test", str(i).encode(), key=str(i))
    seen: list[bytes] = []

    async def handler(message: Message) -> None:
        seen.append(message.raw_body)

    await aconsume(handler)
    stats = async_fake_broker.stats
    assert stats.duplicates > 0 and stats.lost_acks > 0
    assert len(seen) > 40 and set(seen) == {str(i).encode() for i in range(40)}
    assert async_fake_broker.pending == 0
