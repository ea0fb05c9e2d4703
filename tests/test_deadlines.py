"""DeadlineTracker: one wheel timer gives every tracked item its deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from msgpatterns.deadlines import DeadlineTracker
from msgpatterns.timer import TimingWheel


@pytest.fixture
def wheel() -> Iterator[TimingWheel]:
    w = TimingWheel(tick=0.005, slots=64)
    yield w
    w.stop()


def test_items_expire_after_the_timeout_never_before(wheel: TimingWheel) -> None:
    expired: dict[int, float] = {}
    done = threading.Event()
    tracked_at: dict[int, float] = {}

    def on_expire(item: int) -> None:
        expired[item] = time.monotonic()
        if len(expired) == 20:
            done.set()

    tracker: DeadlineTracker[int] = DeadlineTracker(wheel, 0.05, on_expire)
    for i in range(20):
        tracked_at[i] = time.monotonic()
        tracker.track(i)
        time.sleep(0.002)  # spread the deadlines over several ticks
    assert done.wait(5)
    assert all(expired[i] - tracked_at[i] >= 0.05 for i in range(20))
    assert len(tracker) == 0


def test_untracked_items_never_expire(wheel: TimingWheel) -> None:
    expired: list[str] = []
    done = threading.Event()
    tracker: DeadlineTracker[str] = DeadlineTracker(
        wheel, 0.03, lambda item: (expired.append(item), done.set())
    )
    tracker.track("settled")
    tracker.track("forgotten")
    assert tracker.untrack("settled") is True
    assert tracker.untrack("settled") is False
    assert done.wait(5)
    assert expired == ["forgotten"]


def test_tracked_in_bulk_expire_unless_untracked_in_bulk(wheel: TimingWheel) -> None:
    expired: list[int] = []
    done = threading.Event()
    tracker: DeadlineTracker[int] = DeadlineTracker(
        wheel, 0.03, lambda item: (expired.append(item), done.set() if item == 9 else None)
    )
    started = time.monotonic()
    tracker.track_all(range(10))
    tracker.untrack_all([0, 2, 4, 6, 8, 42])  # 42 was never tracked: ignored
    assert done.wait(5)
    assert time.monotonic() - started >= 0.03
    assert expired == [1, 3, 5, 7, 9] and len(tracker) == 0


def test_tracking_again_after_everything_expired_rearms(wheel: TimingWheel) -> None:
    expired: list[int] = []
    first, second = threading.Event(), threading.Event()
    tracker: DeadlineTracker[int] = DeadlineTracker(
        wheel, 0.02, lambda i: (expired.append(i), (first if i == 1 else second).set())
    )
    tracker.track(1)
    assert first.wait(5)
    tracker.track(2)
    assert second.wait(5)
    assert expired == [1, 2]


def test_concurrent_track_and_untrack_lose_nothing(wheel: TimingWheel) -> None:
    expired: set[tuple[int, int]] = set()
    lock = threading.Lock()

    def on_expire(item: tuple[int, int]) -> None:
        with lock:
            expired.add(item)

    tracker: DeadlineTracker[tuple[int, int]] = DeadlineTracker(wheel, 0.02, on_expire)
    kept: set[tuple[int, int]] = set()

    def worker(n: int) -> None:
        for i in range(2000):
            item = (n, i)
            tracker.track(item)
            if i % 10:
                tracker.untrack(item)
            else:
                kept.add(item)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.monotonic() + 10
    while len(expired) < len(kept) and time.monotonic() < deadline:
        time.sleep(0.01)  # waiting for the outcome, not ordering threads
    assert expired == kept


def test_rejects_a_non_positive_timeout(wheel: TimingWheel) -> None:
    with pytest.raises(ValueError, match="positive"):
        DeadlineTracker(wheel, 0, lambda item: None)


def test_a_stopped_wheel_disarms_the_tracker_without_errors(wheel: TimingWheel) -> None:
    """Hole 22 (issue 10): the consumer stops its wheel at stop(); a tracker on it then
    expires nothing and ``track`` from a late thread does not raise."""
    expired: list[int] = []
    tracker: DeadlineTracker[int] = DeadlineTracker(wheel, 0.01, expired.append)
    wheel.stop()
    tracker.track(1)
    tracker.track(2)
    assert tracker.untrack(1) is True
    assert expired == [] and len(wheel) == 0
