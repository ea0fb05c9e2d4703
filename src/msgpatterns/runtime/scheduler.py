"""The retry scheduler: deliveries waiting to run again, on one :class:`Clock`.

Every delayed retry of a consumer waits here - an in-process retry after its backoff,
and (ordered mode) a redelivery kept in the process so that later messages of its key
cannot overtake it. A retry has one due time on one clock: on a real clock a timer
calls ``on_due(item)`` at that time; on a virtual clock nothing fires by itself and the
idle driver takes what is due (:meth:`pop_due`) after moving the clock.

Not thread-safe by itself: the driver calls it under its own lock (the thread driver)
or on its event loop (the asyncio driver); ``on_due`` is called without that lock and
the driver then claims the item with :meth:`take` (False: cancelled meanwhile).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from functools import partial
from types import MappingProxyType
from typing import Generic, TypeVar

from msgpatterns.runtime.clock import Clock
from msgpatterns.timer import Cancellable

__all__ = ["RetryScheduler"]

T = TypeVar("T", bound=Hashable)


class RetryScheduler(Generic[T]):
    """Items waiting until a due time on ``clock``."""

    def __init__(self, clock: Clock, on_due: Callable[[T], object]) -> None:
        self.clock = clock
        self._on_due = on_due
        self._due: dict[T, float] = {}
        self._timers: dict[T, Cancellable] = {}

    def __len__(self) -> int:
        return len(self._due)

    def __contains__(self, item: object) -> bool:
        return item in self._due

    def schedule(self, item: T, delay: float) -> None:
        """``item`` becomes due ``delay`` seconds from now."""
        self._due[item] = self.clock.now() + delay
        timer = self.clock.call_later(delay, partial(self._on_due, item))
        if timer is not None:
            self._timers[item] = timer

    def take(self, item: T) -> bool:
        """Claim ``item`` now (its timer fired, or it is due): True if it was waiting."""
        if self._due.pop(item, None) is None:
            return False
        timer = self._timers.pop(item, None)
        if timer is not None:
            timer.cancel()
        return True

    def waiting(self) -> Mapping[T, float]:
        """What waits, with its due time (read-only view)."""
        return MappingProxyType(self._due)

    def next_due(self) -> float | None:
        """The earliest due time, or None when nothing waits."""
        return min(self._due.values()) if self._due else None

    def pop_due(self) -> list[T]:
        """Take every item due by the clock's ``now``, earliest scheduled first."""
        now = self.clock.now()
        due = [item for item, at in self._due.items() if at <= now]
        for item in due:
            self.take(item)
        return due

    def clear(self) -> list[T]:
        """Cancel everything (the consumer stops); returns what was waiting."""
        items = list(self._due)
        for timer in self._timers.values():
            timer.cancel()
        self._due.clear()
        self._timers.clear()
        return items
