"""TimingWheel: a hashed wheel timer for many short-lived timeouts.

Scheduling and cancelling are O(1): a timer lands in the slot of its target tick; a
timer further away than one turn of the wheel waits in its slot for the right round.
One thread advances the wheel; a callback runs on that thread, so callbacks must be
quick (hand real work to a pool). Precision is one tick.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

from msgpatterns.errors import ClosedError, ConfigurationError, seconds

__all__ = ["Cancellable", "Timer", "TimerHandle", "TimingWheel"]

log = logging.getLogger("msgpatterns.timer")


class Cancellable(Protocol):
    """A scheduled callback that can be cancelled before it runs."""

    def cancel(self) -> object: ...


class Timer(Protocol):
    """What runs a callback after a delay: a :class:`TimingWheel` (its thread), or an
    event loop's ``call_later`` (``msgpatterns.runtime.clock.LoopTimer``)."""

    def schedule(self, delay: float, fn: Callable[[], object]) -> Cancellable: ...


class TimerHandle:
    """A scheduled callback; :meth:`cancel` it before it fires."""

    __slots__ = ("_wheel", "fn", "state", "target_tick")

    def __init__(self, wheel: TimingWheel, target_tick: int, fn: Callable[[], object]) -> None:
        self._wheel = wheel
        self.target_tick = target_tick
        self.fn = fn
        self.state = "pending"  # pending -> fired | cancelled

    def cancel(self) -> bool:
        """Cancel the timer. True if it had not fired or been cancelled yet."""
        return self._wheel._cancel(self)

    @property
    def cancelled(self) -> bool:
        return self.state == "cancelled"

    @property
    def fired(self) -> bool:
        return self.state == "fired"


class TimingWheel:
    """Hashed wheel timer with ``slots`` buckets of ``tick`` seconds each.

    Guarantees: a callback never runs before its delay has elapsed and runs at most one
    tick (plus scheduling noise) after it; callbacks due on the same tick run in the
    order they were scheduled; a cancelled callback never runs; one thread, started on
    the first :meth:`schedule`, runs every callback. An exception in a callback is
    logged and does not stop the wheel.
    """

    def __init__(
        self,
        tick: float | timedelta = 0.1,
        slots: int = 512,
        *,
        name: str = "msgpatterns-timer",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        tick_s = seconds(tick)
        if not tick_s or tick_s <= 0:
            raise ConfigurationError("tick must be positive")
        if slots < 1:
            raise ConfigurationError("slots must be at least 1")
        self.tick: float = tick_s
        self.slots = slots
        self.name = name
        self._clock = clock
        self._wheel: list[dict[TimerHandle, None]] = [{} for _ in range(slots)]
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._start = clock()
        self._current_tick = 0  # last tick processed
        self._count = 0
        self._thread: threading.Thread | None = None
        self._stopped = False

    def __len__(self) -> int:
        """Timers scheduled and not yet fired or cancelled."""
        return self._count

    def schedule(self, delay: float | timedelta, fn: Callable[[], object]) -> TimerHandle:
        """Run ``fn()`` on the wheel thread after ``delay`` seconds; O(1)."""
        delay_s = seconds(delay) or 0.0
        with self._lock:
            if self._stopped:
                raise ClosedError(f"TimingWheel {self.name!r} is stopped")
            now = self._clock() - self._start
            if self._thread is None:  # the thread parks when idle: skip the empty ticks
                self._current_tick = max(self._current_tick, math.floor(now / self.tick))
            elapsed = now + delay_s
            target = max(math.ceil(elapsed / self.tick), self._current_tick + 1)
            handle = TimerHandle(self, target, fn)
            self._wheel[target % self.slots][handle] = None
            self._count += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
        return handle

    def _cancel(self, handle: TimerHandle) -> bool:
        with self._lock:
            if handle.state != "pending":
                return False
            handle.state = "cancelled"
            self._wheel[handle.target_tick % self.slots].pop(handle, None)
            self._count -= 1
            return True

    def stop(self) -> list[TimerHandle]:
        """Stop the thread and return the timers that will now never fire."""
        with self._lock:
            self._stopped = True
            left = [h for slot in self._wheel for h in slot]
            for slot in self._wheel:
                slot.clear()
            for h in left:
                h.state = "cancelled"
            self._count = 0
            thread = self._thread
        self._wakeup.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        return left

    def close(self) -> None:
        """:meth:`stop` (the lifecycle verb every part has); idempotent."""
        self.stop()

    def __enter__(self) -> TimingWheel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while True:
            next_at = self._start + (self._current_tick + 1) * self.tick
            wait = next_at - self._clock()
            if wait > 0 and self._wakeup.wait(wait):
                return  # stopped
            if self._stopped:
                return
            now_tick = math.floor((self._clock() - self._start) / self.tick)
            while self._current_tick < now_tick:
                self._fire(self._current_tick + 1)
            with self._lock:
                if self._count == 0:  # park; schedule() starts a new thread
                    self._thread = None
                    return

    def _fire(self, tick: int) -> None:
        due: list[TimerHandle] = []
        with self._lock:
            slot = self._wheel[tick % self.slots]
            for handle in list(slot):
                if handle.target_tick <= tick:  # later rounds stay in the slot
                    del slot[handle]
                    handle.state = "fired"
                    due.append(handle)
            self._count -= len(due)
            self._current_tick = tick
        for handle in due:
            try:
                handle.fn()
            except Exception:
                log.exception("timer callback %r failed", handle.fn)
