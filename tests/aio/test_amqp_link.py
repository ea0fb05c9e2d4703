"""AmqpLink (AsyncRabbitMQBroker's ack writer) against a model of a RabbitMQ channel whose
writes yield to the event loop: whatever order deliveries are settled or handed back
in, and however the writes interleave, no ack names a tag the channel no longer holds
(RabbitMQ would close the channel: ``PRECONDITION_FAILED - unknown delivery tag``), no
ack covers an unsettled delivery, and every settled delivery is acked. A lost link
writes nothing more and reports its acks as dropped."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from msgpatterns.brokers.rabbitmq._amqp_link import AmqpLink


class Channel:
    """A channel's outstanding deliveries as the server keeps them. A write reaches the
    server in call order (aiormq queues the frame at once) and then yields to the loop
    (waiting for the socket to drain) as many times as the next of ``drains`` says, so
    concurrent writers interleave."""

    def __init__(self, drains: list[int]) -> None:
        self.outstanding: set[int] = set()
        self.acked: set[int] = set()
        self.requeued: set[int] = set()
        self.drains = drains or [0]
        self.writes = 0
        self.error: str | None = None

    async def _drain(self) -> None:
        self.writes += 1
        for _ in range(self.drains[self.writes % len(self.drains)]):
            await asyncio.sleep(0)

    async def basic_ack(self, tag: int, multiple: bool = False) -> None:
        if self.error is not None:
            raise ConnectionError(self.error)
        if tag not in self.outstanding:
            self.error = f"PRECONDITION_FAILED - unknown delivery tag {tag}"
            raise ConnectionError(self.error)
        covered = {t for t in self.outstanding if t <= tag} if multiple else {tag}
        self.outstanding -= covered
        self.acked |= covered
        await self._drain()

    async def basic_nack(self, tag: int, requeue: bool = True) -> None:
        if self.error is not None:
            raise ConnectionError(self.error)
        assert tag in self.outstanding
        self.outstanding.discard(tag)
        self.requeued.add(tag)
        await self._drain()


@settings(max_examples=300)
@given(st.integers(1, 40).flatmap(lambda n: st.tuples(
    st.permutations(range(1, n + 1)),
    st.lists(st.sampled_from(["ack", "nack", "hold"]), min_size=n, max_size=n),
    st.lists(st.integers(0, 3), min_size=n, max_size=n),
    st.lists(st.integers(0, 6), min_size=1, max_size=8),
    st.booleans())))
# Issue 19 hole 2: singles [2, 4] taken by one flush, 2 still draining when 1, 3, 5
# settle; a second flush would write basic_ack(5, multiple=True) before the single 4.
@example(case=([2, 4, 1, 3, 5], ["ack"] * 5, [0, 3, 0, 0, 0], [6], True))
def test_concurrent_acks_never_name_an_unknown_tag(
        case: tuple[list[int], list[str], list[int], list[int], bool]) -> None:
    order, fates, gaps, drains, window = case

    async def scenario() -> Channel:
        channel = Channel(drains)
        link = AmqpLink(1, None, channel, window=window)
        for tag in range(1, len(order) + 1):
            channel.outstanding.add(tag)
            link.delivered(tag)
        tasks = []
        for tag, gap in zip(order, gaps, strict=True):
            fate = fates[tag - 1]
            if fate == "ack":
                tasks.append(asyncio.create_task(link.ack(tag)))
            elif fate == "nack":
                tasks.append(asyncio.create_task(link.nack(tag)))
            for _ in range(gap):  # settlements spread over loop turns
                await asyncio.sleep(0)
        results = await asyncio.gather(*tasks)
        await link.flushed()
        assert all(results), channel.error
        assert not link.lost
        return channel

    channel = asyncio.run(scenario())
    assert channel.error is None
    assert channel.acked == {t for t in order if fates[t - 1] == "ack"}
    assert channel.requeued == {t for t in order if fates[t - 1] == "nack"}
    assert channel.outstanding == {t for t in order if fates[t - 1] == "hold"}


def test_a_lost_link_writes_nothing_and_reports_acks_dropped() -> None:
    lost: list[object] = []

    async def scenario() -> Channel:
        channel = Channel([1])
        link = AmqpLink(1, None, channel, on_lost=lambda link, exc: lost.append(exc))
        for tag in (1, 2, 3):
            channel.outstanding.add(tag)
            link.delivered(tag)
        assert await link.ack(1)
        channel.error = "CONNECTION_FORCED"  # the server closed the connection
        assert not await link.ack(2)  # the write failed: the link is lost
        assert link.lost and len(lost) == 1
        channel.error = None
        assert not await link.ack(3)  # nothing more is written on it
        assert not await link.nack(3)
        return channel

    channel = asyncio.run(scenario())
    assert channel.acked == {1}
    assert channel.outstanding == {2, 3}  # the server redelivers them


@pytest.mark.parametrize("window", [True, False])
def test_an_ack_of_a_tag_not_delivered_on_the_link_writes_nothing(window: bool) -> None:
    async def scenario() -> Channel:
        channel = Channel([0])
        link = AmqpLink(1, None, channel, window=window)
        channel.outstanding.add(1)
        link.delivered(1)
        assert await link.ack(1)
        assert await link.ack(1)  # settled twice: nothing more to send
        assert await link.nack(1)
        assert await link.ack(7)  # never delivered here
        assert await link.nack(7)
        await link.flushed()
        return channel

    channel = asyncio.run(scenario())
    assert channel.error is None and channel.acked == {1} and not channel.requeued
