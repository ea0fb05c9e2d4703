"""Where an ordered topic keeps its routes, its consumers' leases and their progress.

A route store holds, per topic: the committed route versions (the history), at most
one *pending* change (proposed, its command messages being appended, not yet
committed), and per consumer group: the command messages each physical partition's
consumer has recorded, the lease of each physical partition and the live members.

Every store implements :class:`RouteStore` with the same semantics; the conformance
tests run each of them through the same cases:

* :class:`MemoryRouteStore` - one process (tests, with :class:`InMemoryBroker`);
* :class:`~msgpatterns.ordering.SqlRouteStore` - PostgreSQL, MySQL/MariaDB, SQLite;
* :class:`~msgpatterns.ordering.RedisRouteStore` - Redis (Lua scripts).

Guarantees: :meth:`RouteStore.propose` succeeds for exactly one caller per version
(an optimistic compare-and-set on the committed version, with no change pending);
:meth:`RouteStore.commit` moves the pending change into the history only if it is
the proposed version; a lease has one owner at a time and passes to another owner
only when released or expired. Times are seconds on the caller's clock.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from msgpatterns.ordering.routes import Route, check_successor

__all__ = ["MemoryRouteStore", "RouteStore", "TopicState", "may_propose"]


@dataclass(frozen=True)
class TopicState:
    """A topic's committed route and the change in progress, read together."""

    committed: Route
    pending: Route | None = None

    @property
    def publishing(self) -> Route:
        """The route publishers use: the pending change's once it is proposed (its
        closed partitions take no new messages)."""
        return self.pending or self.committed


def may_propose(state: TopicState | None, route: Route) -> bool:
    """Whether ``route`` may become ``state``'s pending change: the topic exists,
    nothing is pending and ``route`` is the next version. RouteError when it is the
    next version but not one valid change of the committed route. (The store's own
    compare-and-set still decides between racing proposers.)"""
    if state is None or state.pending is not None:
        return False
    if state.committed.version != route.version - 1:
        return False
    check_successor(state.committed, route)
    return True


@runtime_checkable
class RouteStore(Protocol):
    """Routes, leases and command records of ordered topics (see the module text)."""

    def create(self, topic: str, route: Route) -> Route:
        """Store version 1 unless the topic exists; returns the committed route."""
        ...

    def state(self, topic: str) -> TopicState | None:
        """The committed route and the pending change; None for an unknown topic."""
        ...

    def history(self, topic: str) -> list[Route]:
        """Every committed version, oldest first (empty for an unknown topic)."""
        ...

    def propose(self, topic: str, route: Route) -> bool:
        """Make ``route`` the pending change iff the committed version is
        ``route.version - 1`` and nothing is pending."""
        ...

    def commit(self, topic: str, version: int) -> bool:
        """Commit the pending change iff it is ``version``."""
        ...

    def record_command(self, topic: str, group: str, version: int, physical: int) -> None:
        """``group``'s consumer of ``physical`` reached version ``version``'s command
        message, every message before it settled (idempotent)."""
        ...

    def commands(self, topic: str, group: str) -> frozenset[tuple[int, int]]:
        """The (version, physical) command messages ``group`` has recorded."""
        ...

    def lease(self, topic: str, group: str, physical: int, owner: str, now: float,
              ttl: float) -> bool:
        """Take or renew the lease of ``physical`` for ``owner`` until ``now + ttl``;
        False while another owner's lease is live."""
        ...

    def release(self, topic: str, group: str, physical: int, owner: str) -> None:
        """Give up ``owner``'s lease of ``physical`` (nothing if it is not the owner)."""
        ...

    def leases(self, topic: str, group: str, now: float) -> dict[int, str]:
        """The live leases: physical partition -> owner."""
        ...

    def expired_leases(self, topic: str, group: str, now: float) -> dict[int, str]:
        """Leases that ran out without being released: physical partition -> the owner
        that stopped renewing (it died, or stalled). Whoever takes such a partition
        over must let the broker redeliver what that owner had fetched first."""
        ...

    def heartbeat(self, topic: str, group: str, owner: str, now: float, ttl: float) -> None:
        """``owner`` is a live member of ``group`` until ``now + ttl``."""
        ...

    def leave(self, topic: str, group: str, owner: str) -> None:
        """``owner`` left ``group`` (it stops counting as a member at once)."""
        ...

    def members(self, topic: str, group: str, now: float) -> list[str]:
        """The live members of ``group``, sorted."""
        ...

    def close(self) -> None:
        """Release what the store opened."""
        ...


class MemoryRouteStore:
    """A :class:`RouteStore` in this process's memory (tests, one process)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._history: dict[str, list[Route]] = {}
        self._pending: dict[str, Route] = {}
        self._commands: dict[tuple[str, str], set[tuple[int, int]]] = {}
        self._leases: dict[tuple[str, str, int], tuple[str, float]] = {}
        self._members: dict[tuple[str, str], dict[str, float]] = {}

    def create(self, topic: str, route: Route) -> Route:
        with self._lock:
            history = self._history.setdefault(topic, [route])
            return history[-1]

    def state(self, topic: str) -> TopicState | None:
        with self._lock:
            history = self._history.get(topic)
            if not history:
                return None
            return TopicState(history[-1], self._pending.get(topic))

    def history(self, topic: str) -> list[Route]:
        with self._lock:
            return list(self._history.get(topic, ()))

    def propose(self, topic: str, route: Route) -> bool:
        with self._lock:
            history = self._history.get(topic)
            state = TopicState(history[-1], self._pending.get(topic)) if history else None
            if not may_propose(state, route):
                return False
            self._pending[topic] = route
            return True

    def commit(self, topic: str, version: int) -> bool:
        with self._lock:
            pending = self._pending.get(topic)
            if pending is None or pending.version != version:
                return False
            self._history[topic].append(self._pending.pop(topic))
            return True

    def record_command(self, topic: str, group: str, version: int, physical: int) -> None:
        with self._lock:
            self._commands.setdefault((topic, group), set()).add((version, physical))

    def commands(self, topic: str, group: str) -> frozenset[tuple[int, int]]:
        with self._lock:
            return frozenset(self._commands.get((topic, group), ()))

    def lease(self, topic: str, group: str, physical: int, owner: str, now: float,
              ttl: float) -> bool:
        with self._lock:
            held = self._leases.get((topic, group, physical))
            if held is not None and held[0] != owner and held[1] > now:
                return False
            self._leases[(topic, group, physical)] = (owner, now + ttl)
            return True

    def release(self, topic: str, group: str, physical: int, owner: str) -> None:
        with self._lock:
            held = self._leases.get((topic, group, physical))
            if held is not None and held[0] == owner:
                del self._leases[(topic, group, physical)]

    def leases(self, topic: str, group: str, now: float) -> dict[int, str]:
        with self._lock:
            return {p: o for (t, g, p), (o, until) in self._leases.items()
                    if t == topic and g == group and until > now}

    def expired_leases(self, topic: str, group: str, now: float) -> dict[int, str]:
        with self._lock:
            return {p: o for (t, g, p), (o, until) in self._leases.items()
                    if t == topic and g == group and until <= now}

    def heartbeat(self, topic: str, group: str, owner: str, now: float, ttl: float) -> None:
        with self._lock:
            self._members.setdefault((topic, group), {})[owner] = now + ttl

    def leave(self, topic: str, group: str, owner: str) -> None:
        with self._lock:
            self._members.get((topic, group), {}).pop(owner, None)

    def members(self, topic: str, group: str, now: float) -> list[str]:
        with self._lock:
            live = self._members.get((topic, group), {})
            return sorted(o for o, until in live.items() if until > now)

    def close(self) -> None:
        """Nothing to release."""

    def __repr__(self) -> str:
        return f"MemoryRouteStore(topics={sorted(self._history)})"
