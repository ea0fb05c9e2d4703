"""TimingWheel: never early, at most about a tick late, cancel, rounds, isolation."""

from __future__ import annotations

import threading
import time

import pytest

from msgpatterns import TimingWheel


@pytest.fixture
def wheel() -> TimingWheel:
    w = TimingWheel(tick=0.005, slots=8)
    yield w
    w.stop()


def _fire_time(wheel: TimingWheel, delay: float) -> float:
    fired = threading.Event()
    at: list[float] = []
    start = time.monotonic()
    wheel.schedule(delay, lambda: (at.append(time.monotonic()), fired.set()))
    assert fired.wait(5)
    return at[0] - start


def test_fires_after_its_delay_never_before(wheel: TimingWheel) -> None:
    assert _fire_time(wheel, 0.02) >= 0.02


def test_delays_longer_than_one_turn_wait_for_their_round(wheel: TimingWheel) -> None:
    # one turn is 8 * 5 ms = 40 ms; 0.13 s needs three more rounds in the same slot
    assert _fire_time(wheel, 0.13) >= 0.13


def test_cancelled_timer_never_runs(wheel: TimingWheel) -> None:
    ran = []
    handle = wheel.schedule(0.01, lambda: ran.append("cancelled"))
    done = threading.Event()
    wheel.schedule(0.03, done.set)
    assert handle.cancel() is True
    assert handle.cancel() is False
    assert done.wait(5)
    assert ran == []
    assert handle.cancelled


def test_same_tick_callbacks_run_in_schedule_order(wheel: TimingWheel) -> None:
    order: list[int] = []
    done = threading.Event()
    for i in range(50):
        wheel.schedule(0.01, lambda i=i: order.append(i))
    wheel.schedule(0.01, done.set)
    assert done.wait(5)
    assert order == list(range(50))


def test_a_failing_callback_does_not_stop_the_wheel(wheel: TimingWheel) -> None:
    done = threading.Event()
    wheel.schedule(0.005, lambda: 1 / 0)
    wheel.schedule(0.02, done.set)
    assert done.wait(5)


def test_many_timers_and_len(wheel: TimingWheel) -> None:
    count = threading.Semaphore(0)
    handles = [wheel.schedule(0.01 + (i % 7) * 0.003, count.release) for i in range(1000)]
    assert len(wheel) <= 1000
    cancelled = sum(h.cancel() for h in handles[::2])
    for _ in range(1000 - cancelled):
        assert count.acquire(timeout=5)
    assert not count.acquire(timeout=0.05)


def test_stop_returns_the_timers_that_will_never_fire() -> None:
    wheel = TimingWheel(tick=0.01, slots=16)
    wheel.schedule(60, lambda: None)
    wheel.schedule(120, lambda: None)
    left = wheel.stop()
    assert len(left) == 2
    with pytest.raises(RuntimeError, match="stopped"):
        wheel.schedule(1, lambda: None)


def test_the_thread_parks_when_idle_and_restarts(wheel: TimingWheel) -> None:
    assert _fire_time(wheel, 0.01) >= 0.01
    deadline = time.monotonic() + 5
    while wheel._thread is not None and time.monotonic() < deadline:
        time.sleep(0.005)  # polling an internal state change, not synchronising work
    assert wheel._thread is None
    assert _fire_time(wheel, 0.01) >= 0.01


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="tick"):
        TimingWheel(tick=0)
    with pytest.raises(ValueError, match="slots"):
        TimingWheel(slots=0)
