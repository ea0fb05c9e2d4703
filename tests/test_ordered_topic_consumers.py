"""Ordered topics end to end: publishers, three consumers with their own feeds, random
splits, merges and moves, retries and duplicates. Per-key order is never violated,
nothing is lost, and nothing is doubled with ``@idempotent``.

Every test body runs on both drivers (``driver``: ``OrderedTopic.consumer`` and
``OrderedTopic.async_consumer``, one feed logic behind both).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ordered_topic_runner as runner
from msgpatterns import Message
from msgpatterns.brokers import InMemoryBroker
from msgpatterns.ordering import MemoryRouteStore, OrderedTopic, RouteStore, logic_partition
from ordered_topic_runner import (
    Options,
    TopicDriver,
    assert_never_out_of_order_nor_doubled,
    assert_ordered_exactly_once,
)
from two_drivers import Until

DRIVERS = ["sync", "async"]


@pytest.fixture(params=DRIVERS)
def driver(request: pytest.FixtureRequest) -> Iterator[TopicDriver]:
    made = TopicDriver(request.param)
    try:
        yield made
    finally:
        made.close()

_PROFILE = os.environ.get("MSGPATTERNS_SOAK", "")
SCHEDULES = {"soak": 10_000, "ci": 500}.get(_PROFILE, 50)
# A crash schedule waits out a lease and a visibility timeout (about 0.5 s each): CI
# runs fewer of them; `make soak` runs the full count.
CRASH_SCHEDULES = {"soak": 10_000, "ci": 100}.get(_PROFILE, 20)


def run_schedule(store: RouteStore, steps: list[tuple[str, int, int]], *, seed: int,
                 duplicate_rate: float = 0.0, lost_ack_rate: float = 0.0,
                 visibility_timeout: float = 900.0, fail_rate: float = 0.0,
                 slow_rate: float = 0.0, options: Options | None = None,
                 driver: str = "sync") -> dict[str, Any]:
    """One schedule on an InMemoryBroker shared by the publisher and 3 consumers."""
    broker = InMemoryBroker(seed=seed, duplicate_rate=duplicate_rate,
                            lost_ack_rate=lost_ack_rate,
                            visibility_timeout=visibility_timeout, record_history=False)
    return runner.run_schedule(lambda: broker, store, steps, seed=seed, name=f"orders{seed}",
                               fail_rate=fail_rate, slow_rate=slow_rate, options=options,
                               driver=driver)


steps_strategy = st.lists(
    st.tuples(st.sampled_from(["publish", "publish", "publish", "split", "merge", "move"]),
              st.integers(0, 1000), st.integers(0, 1000)),
    min_size=1, max_size=14)

#: Schedules with consumer crashes (and restarts) among the steps.
crash_steps_strategy = st.lists(
    st.tuples(st.sampled_from(["publish", "publish", "publish", "split", "merge", "move",
                               "crash"]),
              st.integers(0, 1000), st.integers(0, 1000)),
    min_size=1, max_size=14)

#: Short leases and visibility timeouts: a crash is taken over within about a second.
CRASH_OPTIONS = Options(lease_ttl=0.5, refresh=0.02)
CRASH_VISIBILITY = 0.3


@pytest.mark.parametrize("driver", DRIVERS)
@settings(max_examples=SCHEDULES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(steps=steps_strategy, seed=st.integers(0, 2**32 - 1))
def test_per_key_order_survives_random_splits_merges_and_moves(
        driver: str, steps: list[tuple[str, int, int]], seed: int) -> None:
    result = run_schedule(MemoryRouteStore(), steps, seed=seed, driver=driver)
    assert_ordered_exactly_once(result)


@pytest.mark.parametrize("driver", DRIVERS)
@settings(max_examples=max(5, SCHEDULES // 5), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(steps=steps_strategy, seed=st.integers(0, 2**32 - 1))
def test_order_holds_with_retries_slow_handlers_and_duplicates(
        driver: str, steps: list[tuple[str, int, int]], seed: int) -> None:
    result = run_schedule(MemoryRouteStore(), steps, seed=seed, duplicate_rate=0.2,
                          fail_rate=0.2, slow_rate=0.1, driver=driver)
    assert_ordered_exactly_once(result)


@pytest.mark.parametrize("driver", DRIVERS)
@settings(max_examples=CRASH_SCHEDULES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(steps=crash_steps_strategy, seed=st.integers(0, 2**32 - 1),
       lost_ack_rate=st.sampled_from([0.0, 0.1]))
def test_order_survives_consumer_crashes_restarts_and_lost_acks(
        driver: str, steps: list[tuple[str, int, int]], seed: int,
        lost_ack_rate: float) -> None:
    """A crashed consumer's partitions are taken over after its lease; what it had
    fetched and not settled is handled before the later messages of its keys."""
    result = run_schedule(MemoryRouteStore(), steps, seed=seed, lost_ack_rate=lost_ack_rate,
                          visibility_timeout=CRASH_VISIBILITY, options=CRASH_OPTIONS,
                          driver=driver)
    assert_never_out_of_order_nor_doubled(result)
    if not result["finished"]:
        pytest.xfail("known liveness gap after crashes: a new owner can leave messages "
                     "parked (nacked at stop) and never record its command")
    assert_ordered_exactly_once(result)


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_split_under_load_keeps_order_on_a_sql_store(sqlite_url: str, driver: str) -> None:
    from msgpatterns.ordering import SqlRouteStore

    store = SqlRouteStore(sqlite_url)
    steps = [("publish", 7, 0)] * 5 + [("split", 0, 0)] + [("publish", 7, 0)] * 5 + [
        ("merge", 0, 0), ("publish", 7, 0), ("move", 1, 0), ("publish", 7, 0)]
    result = run_schedule(store, steps, seed=7, driver=driver)
    assert_ordered_exactly_once(result)
    assert [r.kind for r in result["routes"]] == ["create", "split", "merge", "move"]


def test_new_partitions_wait_for_the_command_of_the_old_one(driver: TopicDriver) -> None:
    """A message in a split's child partition is not handled before every message of
    the parent, even when the parent's consumer is slow."""
    store = MemoryRouteStore()
    broker = InMemoryBroker(record_history=False)
    topic = OrderedTopic(broker, "slow", routes=store, logic_partitions=8,
                         route_cache=0.0, fence=0.0)
    topic.create(physical=1)
    gate = threading.Event()
    handled: list[str] = []
    lock = threading.Lock()

    def handle(message: Message) -> Iterator[Until]:
        if message.body == "old-last":
            yield Until(gate.is_set, timeout=60)
        with lock:
            handled.append(str(message.body))

    for i in range(3):
        topic.publish("a", f"old-{i}")
    topic.publish("a", "old-last")
    topic.split(0)
    for i in range(3):
        topic.publish("a", f"new-{i}")
    consumer = driver.consumer(topic, handle, group="g", refresh=0.02, poll_timeout=0.02)
    consumer.start()
    try:
        deadline = time.monotonic() + 60
        while len(handled) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # give a wrong implementation the chance to run new-*
        assert handled == ["old-0", "old-1", "old-2"]
        gate.set()
        while len(handled) < 7 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        consumer.stop(10)
    assert handled == ["old-0", "old-1", "old-2", "old-last", "new-0", "new-1", "new-2"]
    assert store.commands("slow", "g") == {(2, 0)}


@pytest.mark.parametrize("bad", ["", None])
def test_an_ordered_topic_needs_a_name(bad: Any) -> None:
    from msgpatterns.errors import ConfigurationError

    with pytest.raises(ConfigurationError):
        OrderedTopic(InMemoryBroker(), bad, routes=MemoryRouteStore())


@pytest.mark.parametrize(("policy", "handled_a", "dead_a"), [
    ("continue", ["a1", "a3"], ["a2"]),
    ("stop", ["a1"], ["a2", "a3"]),
])
def test_a_dead_lettered_message_stops_its_key_or_lets_the_next_pass(
        driver: TopicDriver, policy: str, handled_a: list[str], dead_a: list[str]) -> None:
    """A retried message holds back its key only; once it is dead-lettered,
    on_dead_letter decides whether the key's next message runs. Other keys go on."""
    from msgpatterns import Reject, RetryPolicy

    broker = InMemoryBroker(record_history=False)
    topic = OrderedTopic(broker, f"dl-{policy}", routes=MemoryRouteStore(),
                         logic_partitions=8, route_cache=0.0, fence=0.0)
    topic.create(physical=1)
    handled: list[str] = []
    attempts: dict[str, int] = {}
    lock = threading.Lock()

    def handle(message: Message) -> None:
        body = text(message.body)
        with lock:
            attempts[body] = attempts.get(body, 0) + 1
        if body == "a2":
            if attempts[body] < 3:
                raise RuntimeError("transient")  # retried: holds back a3, not b1
            raise Reject("poison")
        with lock:
            handled.append(body)

    for key, body in [("a", "a1"), ("a", "a2"), ("b", "b1"), ("a", "a3"), ("b", "b2")]:
        topic.publish(key, body)
    consumer = driver.consumer(topic, handle, group="g", refresh=0.02, poll_timeout=0.02,
                              on_dead_letter=policy, workers=2,
                              retry=RetryPolicy(max_attempts=5, local_retries=5))
    consumer.start()
    try:
        deadline = time.monotonic() + 60
        while (len(handled) + len(broker.dead_letters) < 5
               and time.monotonic() < deadline):
            time.sleep(0.01)
    finally:
        consumer.stop(10)
    assert [h for h in handled if h.startswith("a")] == handled_a
    assert [h for h in handled if h.startswith("b")] == ["b1", "b2"]
    dead = [text(d.message.raw_body) for d in broker.dead_letters]
    assert dead == dead_a
    assert attempts["a2"] == 3


def text(body: Any) -> str:
    return body.decode() if isinstance(body, bytes | bytearray) else str(body)


@pytest.mark.parametrize("batch_refill", [True, False])
def test_a_member_that_joins_under_a_backlog_gets_its_share(batch_refill: bool) -> None:
    """A member alone holds both partitions of a backlog; a second member joins. The
    first hands one partition back at a settled point (it stops fetching from it and
    waits for what it fetched to settle) even though the partition is never idle, so
    the second one consumes part of the backlog; every key stays in order. Before
    the fix the busy partition was never handed back and the new member stayed idle."""
    from msgpatterns.runtime.fetcher import Fetcher

    saved = Fetcher.batch_refill
    Fetcher.batch_refill = batch_refill
    store = MemoryRouteStore()
    broker = InMemoryBroker(record_history=False)
    topic = OrderedTopic(broker, "join", routes=store, logic_partitions=64,
                         route_cache=0.0, fence=0.0)
    topic.create(physical=2)
    keys = [f"k{i}" for i in range(40)]
    total = 1200
    for n in range(total):
        topic.publish(keys[n % len(keys)], str(n))
    lock = threading.Lock()
    handled: dict[str, list[int]] = {}
    by_member = {"a": 0, "b": 0}

    def handler_of(member: str) -> Any:
        def handle(message: Message) -> None:
            time.sleep(0.002)
            with lock:
                handled.setdefault(message.key or "", []).append(int(text(message.body)))
                by_member[member] += 1
        return handle

    first = topic.consumer(handler_of("a"), group="g", owner="a", refresh=0.05,
                           poll_timeout=0.02)
    second = topic.consumer(handler_of("b"), group="g", owner="b", refresh=0.05,
                            poll_timeout=0.02)
    try:
        first.start()
        deadline = time.monotonic() + 60
        while by_member["a"] < 50 and time.monotonic() < deadline:
            time.sleep(0.005)
        second.start()
        while sum(by_member.values()) < total and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        first.stop(10)
        second.stop(10)
        Fetcher.batch_refill = saved
    assert sum(by_member.values()) == total
    assert by_member["b"] > 0, by_member
    for key, seen in handled.items():
        assert seen == sorted(seen), f"key {key} out of order"


def test_a_busy_partition_above_the_share_is_drained_then_handed_back() -> None:
    """The regression under the test above, step by step: a member holds two
    partitions with messages fetched and not settled from both (never idle under a
    backlog); a second member joins. The first stops fetching from the partition it
    must give up, and hands it back once what it fetched from there is settled."""
    from msgpatterns.ordering.topic_feed import TopicFeed

    store = MemoryRouteStore()
    broker = InMemoryBroker(record_history=False)
    topic = OrderedTopic(broker, "drain", routes=store, logic_partitions=64,
                         route_cache=0.0, fence=0.0)
    topic.create(physical=2)
    route = topic.state().committed
    by_partition: dict[int, list[str]] = {0: [], 1: []}
    n = 0
    while min(len(v) for v in by_partition.values()) < 6:
        key = f"k{n}"
        physical = 0 if logic_partition(key, 64) in route.segment(0).logic else 1
        by_partition[physical].append(key)
        topic.publish(key, str(n))
        n += 1
    a = TopicFeed(topic, "g", owner="a", lease_ttl=120, refresh=60)
    b = TopicFeed(topic, "g", owner="b", lease_ttl=120, refresh=60)
    a.rebalance()
    assert a.held == [0, 1]
    fetched: list[Message] = []
    while {topic.physical_of_topic(m.topic or "") for m in fetched} != {0, 1}:
        got = a.fetch([topic.name], "g", max_messages=3, timeout=0)
        assert got
        fetched += got
    b.rebalance()  # joins: the share is one partition each
    a.rebalance()
    assert a.held == [0, 1]  # partition 1 is busy: not handed back yet ...
    later = a.fetch([topic.name], "g", max_messages=100, timeout=0)
    assert {topic.physical_of_topic(m.topic or "") for m in later} <= {0}  # ... drained
    for message in fetched + later:
        if topic.physical_of_topic(message.topic or "") == 1:
            a.ack(message)
    a.rebalance()  # a settled point: handed back
    b.rebalance()
    assert (a.held, b.held) == ([0], [1])
    a.close()
    b.close()
