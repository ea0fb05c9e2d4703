"""The one clock delayed retries run on: real time, or a broker's virtual time.

* :class:`RealClock` - due times on the broker's clock, callbacks fired by a
  :class:`~msgpatterns.timer.Timer` (the thread driver's :class:`~msgpatterns.TimingWheel`,
  the asyncio driver's :class:`LoopTimer`).
* :class:`VirtualClock` - the in-memory fake's virtual time: nothing fires by itself;
  the idle driver (:mod:`msgpatterns.runtime.idle`) moves the clock to the next due
  moment when nothing else can run (``run_until_idle``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from msgpatterns.brokers.base import SupportsVirtualTime
from msgpatterns.timer import Cancellable, Timer

__all__ = ["Clock", "LoopTimer", "RealClock", "VirtualClock"]


class Clock(Protocol):
    """Where delayed retries wait."""

    #: True when time only moves when :meth:`advance_to` is called.
    virtual: bool

    def now(self) -> float:
        """The current time (the broker's clock)."""
        ...

    def call_later(self, delay: float, fn: Callable[[], object]) -> Cancellable | None:
        """Run ``fn`` after ``delay`` seconds; None on a virtual clock (the idle driver
        releases what is due instead)."""
        ...

    def advance_to(self, when: float) -> None:
        """Move a virtual clock forward to ``when`` (a real clock ignores it)."""
        ...


class RealClock:
    """Real time: ``now`` is the broker's clock, ``call_later`` a timer callback."""

    virtual = False

    def __init__(self, now: Callable[[], float], timer: Timer) -> None:
        self.now = now
        self._timer = timer

    def call_later(self, delay: float, fn: Callable[[], object]) -> Cancellable | None:
        return self._timer.schedule(delay, fn)

    def advance_to(self, when: float) -> None:
        return None


class VirtualClock:
    """A broker's virtual time (the in-memory fakes): moved by the idle driver only.
    Without a broker it is a clock that never moves (a consumer not started yet)."""

    virtual = True

    def __init__(self, broker: SupportsVirtualTime | None, now: Callable[[], float]) -> None:
        self._broker = broker
        self.now = now

    def call_later(self, delay: float, fn: Callable[[], object]) -> Cancellable | None:
        return None

    def advance_to(self, when: float) -> None:
        if self._broker is not None:
            self._broker.advance_to(when)


class LoopTimer:
    """A :class:`~msgpatterns.timer.Timer` on an asyncio event loop: ``call_later``
    handles, all cancelled by :meth:`stop`; once stopped it refuses to schedule (a
    :class:`~msgpatterns.deadlines.DeadlineTracker` on it then stays disarmed)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._handles: set[asyncio.TimerHandle] = set()
        self._stopped = False

    def schedule(self, delay: float, fn: Callable[[], object]) -> asyncio.TimerHandle:
        if self._stopped:
            raise RuntimeError("the consumer's timer is stopped")
        handle: asyncio.TimerHandle

        def fire() -> None:
            self._handles.discard(handle)
            fn()

        handle = self._loop.call_later(delay, fire)
        self._handles.add(handle)
        return handle

    def stop(self) -> None:
        self._stopped = True
        for handle in self._handles:
            handle.cancel()
        self._handles.clear()
