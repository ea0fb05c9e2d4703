"""The in-memory fake's state, one consumer group on one topic at a time: the
entries, the lanes (ready, delayed, in flight with their leases, deliveries, settled)
and a delivery's receipt. Used by :class:`~msgpatterns.brokers.memory.broker.InMemoryBroker`
under its lock."""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = ["Entry", "Lane", "Picked", "Receipt", "drop_settled_leases"]


@dataclass(slots=True)
class Entry:
    uid: int
    id: str
    topic: str
    body: Any
    key: str | None
    headers: dict[str, str]
    timestamp: float
    offset: int


class Receipt(NamedTuple):
    """One delivery's handle (immutable; a tuple: cheap to make per delivery)."""

    group: str
    topic: str
    uid: int
    token: int


#: One delivery picked under the lock: (entry, headers, attempt, receipt).
Picked = tuple[Entry, dict[str, str], int, Receipt]


@dataclass
class Lane:
    """The state of one consumer group on one topic."""

    ready: deque[Entry] = field(default_factory=deque)
    delayed: list[tuple[float, int, Entry]] = field(default_factory=list)
    inflight: dict[int, tuple[int, float, Entry]] = field(default_factory=dict)
    leases: list[tuple[float, int, int]] = field(default_factory=list)  # (deadline, token, uid)
    deliveries: dict[int, int] = field(default_factory=dict)
    headers: dict[int, dict[str, str]] = field(default_factory=dict)
    done: dict[int, tuple[str, int]] = field(default_factory=dict)  # uid -> (state, token)
    entries: int = 0


def drop_settled_leases(lane: Lane) -> None:
    """Drop the leases of settled (or redelivered) deliveries at once, instead of one
    heap pop each when they come due: the heap stays about as large as what is in
    flight, however long the broker runs."""
    inflight = lane.inflight
    lane.leases = [lease for lease in lane.leases
                   if inflight.get(lease[2], (None,))[0] == lease[1]]
    heapq.heapify(lane.leases)
