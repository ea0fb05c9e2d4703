"""DeadlineTracker: expire items that stay tracked longer than one fixed timeout.

Every item gets the same timeout, so the order items are tracked in is the order
their deadlines fall in. The tracker keeps them in an insertion-ordered dict (O(1)
``track`` and ``untrack``, no allocation beyond the dict slot) and keeps ONE timer on a
:class:`~msgpatterns.TimingWheel` (or any :class:`~msgpatterns.timer.Timer`), due when
the oldest tracked item expires. This is how
the consumer gives every unacked message its ack deadline without scheduling and
cancelling a timer per message.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from itertools import repeat
from typing import Generic, TypeVar

from msgpatterns.errors import ConfigurationError
from msgpatterns.timer import Timer

__all__ = ["DeadlineTracker"]

T = TypeVar("T", bound=Hashable)


class DeadlineTracker(Generic[T]):
    """Calls ``on_expire(item)`` (on the wheel thread) for every item tracked longer
    than ``timeout`` seconds and not untracked since.

    Guarantees: an item is never expired before its timeout; it is expired at most one
    wheel tick (plus scheduling noise) after it; an untracked item is never expired;
    ``on_expire`` runs at most once per :meth:`track`. ``track``/``untrack`` are safe
    from any thread and take no lock. Once the wheel is stopped nothing more is
    expired, and ``track`` does not raise.
    """

    def __init__(
        self,
        wheel: Timer,
        timeout: float,
        on_expire: Callable[[T], object],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout <= 0:
            raise ConfigurationError("timeout must be positive")
        self._wheel = wheel
        self._timeout = timeout
        self._on_expire = on_expire
        self._clock = clock
        self._due: dict[T, float] = {}
        #: ``forget(item, None)``: :meth:`untrack` without its result and without a
        #: Python frame (the dict's own ``pop``: the per-message hot path).
        self.forget: Callable[[T, None], float | None] = self._due.pop
        self._armed = False
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._due)

    def track(self, item: T) -> None:
        """Start the timeout of a new ``item`` now."""
        self._due[item] = self._clock() + self._timeout
        if not self._armed:
            self._arm(self._timeout)

    def track_all(self, items: Iterable[T]) -> None:
        """:meth:`track` each of ``items`` (one clock read: their timeouts start now)."""
        due = self._clock() + self._timeout
        self._due.update(dict.fromkeys(items, due))
        if self._due and not self._armed:
            self._arm(self._timeout)

    def untrack_all(self, items: Iterable[T]) -> None:
        """:meth:`untrack` each of ``items``."""
        deque(map(self._due.pop, items, repeat(None)), maxlen=0)  # C speed

    def untrack(self, item: T) -> bool:
        """Stop ``item``'s timeout; False if it was not tracked (or already expired)."""
        return self._due.pop(item, None) is not None

    def _arm(self, delay: float) -> None:
        with self._lock:
            if not self._armed:
                self._schedule(delay)

    def _schedule(self, delay: float) -> None:
        """Lock held: arm the sweep; a stopped wheel leaves the tracker disarmed (its
        owner is shutting down: nothing is expired after that)."""
        try:
            self._wheel.schedule(delay, self._sweep)
        except RuntimeError:
            self._armed = False
        else:
            self._armed = True

    def _sweep(self) -> None:
        now = self._clock()
        expired: list[T] = []
        next_due: float | None = None
        with self._lock:
            for item, due in list(self._due.items()):  # oldest first; one C-level copy
                if due > now:
                    next_due = due
                    break
                expired.append(item)
            if next_due is None:
                self._armed = False
            else:
                self._schedule(next_due - now)
        for item in expired:
            if self._due.pop(item, None) is not None:  # not untracked meanwhile
                self._on_expire(item)
        if self._due and not self._armed:  # tracked while we were disarming
            self._arm(self._timeout)
