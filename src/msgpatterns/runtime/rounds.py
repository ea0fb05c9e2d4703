"""Batch claims of an ``@idempotent`` handler: the messages of one claim round.

One round is the claimed messages of one batch claim, run one by one (on any worker,
or on their keys' lanes): whoever runs the last one finishes the round (one
completion, one release, then the acks - DONE before ack).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from msgpatterns.idempotency.batch import BatchGuard, Entry
from msgpatterns.message import Message
from msgpatterns.ordering.executor import OrderedExecutor

__all__ = ["Claimed", "Round"]


class Round:
    """The claimed messages of one batch claim and how each run ended."""

    __slots__ = ("_left", "_lock", "lanes", "later", "raised", "returned")

    def __init__(self, size: int, later: list[Message],
                 lanes: OrderedExecutor | None) -> None:
        self._left = size
        self._lock = threading.Lock()
        #: Messages to prepare again after this round (their key is held by it).
        self.later = later
        self.lanes = lanes
        self.returned: list[Entry] = []
        self.raised: list[tuple[Entry, BaseException]] = []

    def add(self, entry: Entry | None, error: BaseException | None) -> bool:
        """One message ran: ``entry`` returned (``error`` None) or raised; None when
        its claim is finished elsewhere. True for the last one."""
        with self._lock:
            if entry is not None:
                if error is None:
                    self.returned.append(entry)
                else:
                    self.raised.append((entry, error))
            self._left -= 1
            return self._left == 0


@dataclass(eq=False, slots=True)
class Claimed:
    """A claimed message waiting for a worker, with the round it belongs to."""

    guard: BatchGuard
    batch: Round
    entry: Entry
