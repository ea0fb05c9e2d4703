"""OrderedExecutor: per-key FIFO across resizes, isolated failures, complete shutdown."""

from __future__ import annotations

import itertools
import random
import threading
import time
import zlib
from collections import defaultdict
from concurrent.futures import Future

import pytest

from msgpatterns.ordering import OrderedExecutor, lane_ranges, logic_partition


def test_logic_partition_is_a_stable_hash_not_pythons_salted_one() -> None:
    # Fixed values: Python's hash() of a str changes with PYTHONHASHSEED, these never do.
    assert logic_partition("order-42", 1024) == zlib.crc32(b"order-42") % 1024 == 734
    assert logic_partition(b"order-42", 1024) == 734
    assert logic_partition(42, 1024) == logic_partition("42", 1024)
    with pytest.raises(TypeError, match="ordering key"):
        logic_partition(4.2, 1024)  # type: ignore[arg-type]


def test_lane_ranges_are_contiguous_and_cover_every_partition() -> None:
    for lanes in (1, 3, 7, 1024):
        ranges = lane_ranges(lanes, 1024)
        assert len(ranges) == lanes
        assert ranges[0].start == 0
        assert ranges[-1].stop == 1024
        assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))
    with pytest.raises(ValueError, match="lanes"):
        lane_ranges(0, 1024)
    with pytest.raises(ValueError, match="lanes"):
        lane_ranges(9, 8)


def test_per_key_order_holds_under_random_resizes_during_load() -> None:
    keys_per_submitter, per_key, submitters = 25, 60, 3
    seen: dict[str, list[int]] = defaultdict(list)
    running: set[str] = set()
    overlaps: list[str] = []
    guard = threading.Lock()
    rng = random.Random(7)

    def task(key: str, seq: int, pause: float) -> None:
        with guard:
            if key in running:
                overlaps.append(key)
            running.add(key)
        time.sleep(pause)  # uneven work, so backlogs build up behind some lanes
        seen[key].append(seq)
        with guard:
            running.discard(key)

    executor = OrderedExecutor(2, logic_partitions=64, name="resize-test")
    start = threading.Barrier(submitters + 1)
    done = threading.Event()
    resizes = []

    def submit(worker: int) -> None:
        local = random.Random(worker)
        keys = [f"w{worker}-k{i}" for i in range(keys_per_submitter)]
        start.wait()
        for seq in range(per_key):
            for key in local.sample(keys, len(keys)):
                executor.submit(key, task, key, seq, local.choice((0.0, 0.0, 0.0, 0.0005)))

    def resize() -> None:
        start.wait()
        while not done.is_set():
            lanes = rng.randint(1, 8)
            executor.resize(lanes)
            resizes.append(lanes)
            done.wait(0.002)

    threads = [threading.Thread(target=submit, args=(w,)) for w in range(submitters)]
    resizer = threading.Thread(target=resize)
    for thread in [*threads, resizer]:
        thread.start()
    for thread in threads:
        thread.join()
    done.set()
    resizer.join()
    executor.shutdown(wait=True)

    assert len(resizes) > 1
    assert overlaps == []
    assert len(seen) == submitters * keys_per_submitter
    bad = {k: v for k, v in seen.items() if v != list(range(per_key))}
    assert bad == {}


def _key_where(executor: OrderedExecutor, lanes: int, old: int, new: int, skip: int = -1) -> str:
    """A key on lane ``old`` now and on lane ``new`` after resizing to ``lanes`` lanes."""
    before = lane_ranges(executor.lanes, executor.logic_partitions)
    after = lane_ranges(lanes, executor.logic_partitions)
    for i in range(10_000):
        key = f"key-{i}"
        p = executor.partition_of(key)
        if p != skip and p in before[old] and p in after[new]:
            return key
    raise AssertionError("no such key")


def test_a_moved_partition_waits_for_its_old_lane_to_drain() -> None:
    release = threading.Event()
    order: list[str] = []
    # 16 partitions on 2 lanes: [0, 8) [8, 16); on 3 lanes: [0, 5) [5, 10) [10, 16).
    with OrderedExecutor(2, logic_partitions=16) as executor:
        try:
            moved = _key_where(executor, 3, old=0, new=1)
            stays = _key_where(executor, 3, old=1, new=1)

            def first() -> None:
                release.wait()
                order.append("first")

            blocker = executor.submit(moved, first)
            executor.resize(3)
            assert executor.lane_of(moved) == executor.lane_of(stays) == 1
            second = executor.submit(moved, order.append, "second")
            # Submitted after "second" to the same lane, on a partition that did not move:
            # once it has run, that lane has run everything queued before it.
            executor.submit(stays, lambda: None).result(timeout=10)
            assert not second.done()
            assert order == []
        finally:
            release.set()
        second.result(timeout=10)
        blocker.result(timeout=10)
    assert order == ["first", "second"]


def test_a_failing_task_sets_its_future_and_the_lane_goes_on() -> None:
    def boom() -> None:
        raise ValueError("boom")

    with OrderedExecutor(1) as executor:
        futures: list[Future[object]] = [executor.submit("k", boom)]
        futures += [executor.submit("k", int, i) for i in range(3)]
        futures.append(executor.submit("other", boom))
        futures.append(executor.submit("other", lambda: "after"))
    with pytest.raises(ValueError, match="boom"):
        futures[0].result()
    assert [f.result() for f in futures[1:4]] == [0, 1, 2]
    assert isinstance(futures[4].exception(), ValueError)
    assert futures[5].result() == "after"


def test_shutdown_wait_runs_everything_submitted_also_held_tasks() -> None:
    executor = OrderedExecutor(1, logic_partitions=32, name="drain")
    release = threading.Event()
    key = _key_where(executor, 3, old=0, new=1)
    executor.submit(key, release.wait)
    executor.resize(3)
    counts: dict[str, int] = defaultdict(int)
    futures: list[Future[object]] = [
        executor.submit(f"k{i % 50}", counts.__setitem__, f"k{i % 50}", i) for i in range(2000)
    ]
    futures.append(executor.submit(key, str, "held"))  # held behind the blocked lane
    threads = [t for t in threading.enumerate() if t.name.startswith("drain-lane-")]
    assert len(threads) == 3
    stopper = threading.Thread(target=executor.shutdown, kwargs={"wait": True})
    stopper.start()
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.submit("late", lambda: None)
    release.set()
    stopper.join()
    assert all(f.done() for f in futures)
    assert futures[-1].result() == "held"
    assert executor.pending == 0
    assert not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError, match="after shutdown"):
        executor.resize(2)


def test_shutdown_without_wait_still_finishes_the_work() -> None:
    executor = OrderedExecutor(2, name="nowait")
    gate = threading.Event()
    futures: list[Future[object]] = [
        executor.submit("a", gate.wait), executor.submit("a", str, "done")
    ]
    executor.shutdown(wait=False)
    assert not futures[1].done()
    gate.set()
    assert futures[1].result(timeout=10) == "done"


def test_a_task_can_shut_its_own_executor_down() -> None:
    executor = OrderedExecutor(1)
    inner = executor.submit("k", executor.shutdown, True)
    inner.result(timeout=10)
    executor.shutdown(wait=True)


def test_cancelled_tasks_are_skipped() -> None:
    with OrderedExecutor(1) as executor:
        gate = threading.Event()
        executor.submit("k", gate.wait)
        cancelled = executor.submit("k", lambda: "never")
        after = executor.submit("k", lambda: "after")
        assert cancelled.cancel()
        gate.set()
    assert cancelled.cancelled()
    assert after.result() == "after"


def test_resize_to_the_same_size_keeps_lanes_and_bad_sizes_are_refused() -> None:
    with OrderedExecutor(3, logic_partitions=8, name="same") as executor:
        before = {t.name for t in threading.enumerate() if t.name.startswith("same-lane-")}
        executor.resize(3)
        after = {t.name for t in threading.enumerate() if t.name.startswith("same-lane-")}
        assert before == after == {"same-lane-0", "same-lane-1", "same-lane-2"}
        with pytest.raises(ValueError, match="lanes"):
            executor.resize(9)
        with pytest.raises(ValueError, match="lanes"):
            executor.resize(0)
