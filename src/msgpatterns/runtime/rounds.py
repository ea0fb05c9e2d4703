"""Batch claims of an ``@idempotent`` handler: the messages of one claim round, and the
completions of the handlers that returned.

One round is the claimed messages of one batch claim, run one by one (on any worker,
or on their keys' lanes). Each message's claim is finished as its own handler ends -
never when the round's slowest handler ends: a handler that raised releases its claim
itself; one that returned queues its claim in :class:`Completions`, which writes the
claims of the handlers that returned together in one round trip, then their acks (DONE
before ack). The round only keeps count, so that the messages it had to hold back (a
repeat of a key it claimed) are prepared again once every claim of the round is
finished.

Both drivers use these parts: the thread driver (:mod:`msgpatterns.consumer`) and the
asyncio driver (:mod:`msgpatterns.aio.consumer`) differ only in how they wait.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from msgpatterns.errors import AckTimeout
from msgpatterns.idempotency.batch import BatchGuard, Entry
from msgpatterns.message import Message
from msgpatterns.ordering.executor import OrderedExecutor
from msgpatterns.runtime.lifecycle import Released

__all__ = ["Claimed", "Completions", "Round", "expired"]


def expired(error: BaseException | None) -> bool:
    """The settlement came from the runtime - the ack deadline
    (:class:`~msgpatterns.errors.AckTimeout`) or a stop handing the message back - not
    from its handler: it never takes the claim of a handler still running."""
    return isinstance(error, AckTimeout | Released)


class Round:
    """The claimed messages of one batch claim: how many have not finished yet, and the
    messages to prepare again once they all have."""

    __slots__ = ("_left", "_lock", "lanes", "later")

    def __init__(self, size: int, later: list[Message],
                 lanes: OrderedExecutor | None) -> None:
        self._left = size
        self._lock = threading.Lock()
        #: Messages to prepare again after this round (their key is held by it).
        self.later = later
        self.lanes = lanes

    def ended(self) -> bool:
        """One message of the round is finished (its claim completed or released, or
        left to its settlement); True for the last one."""
        with self._lock:
            self._left -= 1
            return self._left == 0


@dataclass(eq=False, slots=True)
class Claimed:
    """A claimed message (waiting for a worker, or whose handler returned), with the
    round it belongs to."""

    guard: BatchGuard
    batch: Round
    entry: Entry


class Completions:
    """The claims of handlers that returned, waiting to be completed: a group commit.

    A worker whose handler returned :meth:`add`\\ s its claim. When no completion is
    being written, that worker becomes the writer: it :meth:`take`\\ s everything queued
    (its own claim and whatever else returned by then), writes it in one round trip,
    sends those acks, and takes again until nothing is left. Otherwise it goes on with
    its next message: the writer under way takes its claim next. So a claim is written
    as soon as the store is free - never held back for a handler still running - and
    the handlers that return while a round trip is under way share the next one.
    Thread-safe; the asyncio driver uses it on its loop.
    """

    __slots__ = ("_lock", "_queue", "_writing")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[Claimed] = []
        self._writing = False

    def add(self, claimed: Claimed) -> bool:
        """Queue ``claimed``; True when the caller must now write (it is the writer)."""
        with self._lock:
            self._queue.append(claimed)
            if self._writing:
                return False
            self._writing = True
            return True

    def abandon(self) -> None:
        """The writer dies (a ``BaseException`` from the store call): the next claim
        queued makes a new writer, who takes what is queued."""
        with self._lock:
            self._writing = False

    def take(self) -> list[Claimed]:
        """For the writer: everything queued, or an empty list - and then it is no
        longer the writer (atomically: a claim queued afterwards makes a new writer)."""
        with self._lock:
            taken, self._queue = self._queue, []
            if not taken:
                self._writing = False
            return taken
