"""What sets the three batching helpers apart: BatchExecutor batches only under load,
Flusher's deadline runs from a batch's oldest item, MultipleQueueFlusher never mixes
channels and refuses an impossible route.

The tests taking ``make`` run on the sync helpers and on their async twins, one body
behind batching_modes' sync face; the plan tests check the policy both drivers share."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batching_modes import MODES, Batching, Kind, batching
from msgpatterns import Group
from msgpatterns.batching import RouteError
from msgpatterns.batching.core import Channel, plan
from msgpatterns.errors import ConfigurationError

GUARD = 30.0  # only bounds a hang if the code under test is broken
Make = Batching


@pytest.fixture(params=MODES)
def make(request: pytest.FixtureRequest) -> Iterator[Make]:
    """``make(kind, processor, **options)`` on the sync API or the async one."""
    with batching(request.param) as modes:
        yield modes

# -- BatchExecutor ------------------------------------------------------------------


def test_batch_executor_batches_grow_while_the_processor_is_slow(make: Make) -> None:
    sizes: list[int] = []
    first_started = threading.Event()
    release = threading.Event()

    def slow(batch: list[int]) -> None:
        sizes.append(len(batch))
        if len(sizes) == 1:
            first_started.set()
            assert release.wait(GUARD)

    with make("executor", slow, name="slow", batch_size=10, threads=1) as executor:
        executor.add(0)
        assert first_started.wait(GUARD)  # the only worker is now busy with [0]
        for i in range(1, 26):
            executor.add(i)
        release.set()
    assert sizes == [1, 10, 10, 5]


def test_batch_executor_sends_each_item_alone_while_the_processor_keeps_up(
    make: Make,
) -> None:
    sizes: list[int] = []
    processed = threading.Event()

    def fast(batch: list[int]) -> None:
        sizes.append(len(batch))
        processed.set()

    with make("executor", fast, name="fast", batch_size=10, threads=2) as executor:
        for i in range(50):
            processed.clear()
            executor.add(i)
            assert processed.wait(GUARD), "an idle worker must take a lone item at once"
    assert sizes == [1] * 50


# -- Flusher ------------------------------------------------------------------------


def test_flusher_sends_a_full_batch_without_waiting_for_the_interval(make: Make) -> None:
    batches: list[list[int]] = []
    sent = threading.Event()

    def processor(batch: list[int]) -> None:
        batches.append(batch)
        sent.set()

    with make("flusher", processor, name="full", batch_size=5, flush_interval=3600.0,
              queue_size=100, threads=1) as flusher:
        for i in range(4):
            flusher.add(i)
        assert not sent.is_set()
        flusher.add(4)
        assert sent.wait(GUARD)
        assert batches == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize("kind", ["flusher", "multiple"])
def test_flusher_sends_a_partial_batch_once_its_oldest_item_waited_the_interval(
    make: Make, kind: Kind,
) -> None:
    sent = threading.Event()
    batches: list[list[int]] = []

    def processor(batch: list[int]) -> None:
        batches.append(batch)
        sent.set()

    with make(kind, processor, name="partial", batch_size=100, flush_interval=0.02,
              queue_size=100, threads=1) as flusher:
        flusher.add(1)
        assert sent.wait(GUARD), "a lone item must go out after flush_interval"
        assert batches == [[1]]


def channel_with(stamps: list[float], index: int = 0, taken: int = 0) -> Channel[int]:
    channel: Channel[int] = Channel(index, 1000)
    for i, stamp in enumerate(stamps):
        channel.items.append(i)
        channel.stamps.append(stamp)
    channel.taken = channel.enqueued = taken
    channel.enqueued += len(stamps)
    return channel


def test_plan_deadline_runs_from_the_oldest_item_not_from_the_last_flush() -> None:
    # A periodic flusher that last flushed at 0.0 would send this item at 2.0 (when
    # its second period ends): nearly twice the interval. The deadline is 1.9 + 1.0.
    channel = channel_with([1.9])
    assert plan([channel], 2.0, batch_size=10, max_wait=1.0, draining=False) == (None, 2.9)
    assert plan([channel], 2.9, batch_size=10, max_wait=1.0, draining=False) == (channel, None)


def test_plan_waits_for_the_oldest_of_several_items() -> None:
    channel = channel_with([0.0, 0.5, 0.9])
    assert plan([channel], 0.99, batch_size=10, max_wait=1.0, draining=False) == (None, 1.0)
    assert plan([channel], 1.0, batch_size=10, max_wait=1.0, draining=False)[0] is channel


def test_plan_sends_a_full_batch_at_once() -> None:
    channel = channel_with([0.0] * 10)
    assert plan([channel], 0.0, batch_size=10, max_wait=1.0, draining=False)[0] is channel


def test_plan_sends_everything_while_draining_and_flushed_items_at_once() -> None:
    channel = channel_with([5.0])
    assert plan([channel], 5.0, batch_size=10, max_wait=1.0, draining=True)[0] is channel
    channel.flush_mark = channel.enqueued
    assert plan([channel], 5.0, batch_size=10, max_wait=1.0, draining=False)[0] is channel
    channel.flush_mark = channel.taken  # the flush covered earlier items only
    assert plan([channel], 5.0, batch_size=10, max_wait=1.0, draining=False) == (None, 6.0)


def test_plan_with_zero_wait_sends_whatever_is_queued_and_sleeps_when_empty() -> None:
    channel = channel_with([7.0])
    assert plan([channel], 7.0, batch_size=10, max_wait=0.0, draining=False)[0] is channel
    empty = channel_with([])
    assert plan([empty], 7.0, batch_size=10, max_wait=0.0, draining=False) == (None, None)


def test_plan_picks_the_due_channel_with_the_oldest_item() -> None:
    young = channel_with([3.0], index=0)
    old = channel_with([1.0], index=1)
    waiting = channel_with([4.5], index=2)
    assert plan([young, old, waiting], 4.0, 10, 1.0, False)[0] is old
    assert plan([young, waiting], 4.0, 10, 1.0, False)[0] is young
    assert plan([waiting], 4.0, 10, 1.0, False) == (None, 5.5)


# -- MultipleQueueFlusher -----------------------------------------------------------


def test_groups_never_mix_channels_under_concurrent_producers(make: Make) -> None:
    channels = 4
    groups: list[Group[int]] = []
    lock = threading.Lock()

    def processor(group: Group[int]) -> None:
        with lock:
            groups.append(group)

    flusher = make("multiple", processor, groups=True, name="shards", channels=channels,
                   queue_size=100, batch_size=16, flush_interval=0.005, threads=3,
                   route=lambda n: n % channels)
    start = threading.Barrier(4)

    def produce(first: int) -> None:
        start.wait()
        for n in range(first, first + 1000):
            assert flusher.add(n, timeout=GUARD)

    producers = [threading.Thread(target=produce, args=(p * 1000,)) for p in range(4)]
    for thread in producers:
        thread.start()
    for thread in producers:
        thread.join()
    assert flusher.close()
    mixed = [g for g in groups if any(n % channels != g.index for n in g.items)]
    assert not mixed, f"groups mixing channels: {mixed[:3]}"
    assert Counter(n for g in groups for n in g.items) == Counter(range(4000))
    assert all(1 <= len(g) <= 16 for g in groups)


def test_every_item_lands_once_in_a_group_of_its_own_channel(make: Make) -> None:
    examples = 25 if make.mode == "sync" else 10

    @settings(max_examples=examples, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(
        channels=st.integers(min_value=1, max_value=6),
        batch_size=st.integers(min_value=1, max_value=8),
        keys=st.lists(st.text(max_size=3), max_size=60),
    )
    def check(channels: int, batch_size: int, keys: list[str]) -> None:
        def route(item: tuple[int, str]) -> int:
            return len(item[1]) * 7 % channels

        groups: list[Group[tuple[int, str]]] = []
        items = list(enumerate(keys))
        with make("multiple", groups.append, groups=True, name="prop", channels=channels,
                  queue_size=64, batch_size=batch_size, flush_interval=3600.0, threads=2,
                  route=route) as flusher:
            for item in items:
                assert flusher.add(item, timeout=GUARD)
        assert all(route(item) == g.index for g in groups for item in g.items)
        assert sorted(item for g in groups for item in g.items) == items
        assert all(len(g) <= batch_size for g in groups)

    check()


@pytest.mark.parametrize("chosen", [3, 7, -1, 1.5, "0", None])
def test_an_impossible_route_raises_at_add_and_the_item_is_not_accepted(
    make: Make, chosen: Any
) -> None:
    processed: list[Group[str]] = []
    with make("multiple", processed.append, groups=True, name="routes", channels=3,
              queue_size=10, batch_size=5, flush_interval=3600.0, threads=1,
              route=lambda item: chosen) as flusher:
        with pytest.raises(RouteError, match="route returned"):
            flusher.add("item")
        assert flusher.counters.items == 0
    assert processed == []
    assert issubclass(RouteError, ConfigurationError)
    assert issubclass(RouteError, ValueError)


def test_a_route_that_raises_refuses_the_item(make: Make) -> None:
    def route(item: str) -> int:
        raise KeyError(item)

    with make("multiple", print, groups=True, name="raising", channels=2, queue_size=10,
              batch_size=5, flush_interval=3600.0, threads=1, route=route) as flusher:
        with pytest.raises(KeyError):
            flusher.add("unknown-shard")
        assert flusher.counters.items == 0


def test_queue_size_is_per_channel_so_a_full_channel_does_not_block_the_others(
    make: Make,
) -> None:
    release = threading.Event()
    groups: list[Group[tuple[int, int]]] = []

    def processor(group: Group[tuple[int, int]]) -> None:
        if group.index == 0:
            assert release.wait(GUARD)
        groups.append(group)

    with make("multiple", processor, groups=True, name="hot", channels=2, queue_size=6,
              batch_size=3, flush_interval=3600.0, threads=2,
              route=lambda item: item[0]) as flusher:
        accepted = 0
        while flusher.add((0, accepted)):
            accepted += 1
        assert accepted == 6
        for n in range(6):
            assert flusher.add((1, n)), "channel 1 is not full"
        assert not flusher.add((1, 6))
        assert flusher.counters.depth == 12
        release.set()
    assert sorted(item for g in groups for item in g.items) == sorted(
        [(0, n) for n in range(6)] + [(1, n) for n in range(6)]
    )
