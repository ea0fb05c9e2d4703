"""Versioned routes from logic partitions to physical partitions (sans-I/O).

A key maps to a fixed logic partition (:func:`~msgpatterns.ordering.logic_partition`,
CRC-32 modulo ``logic_partitions``, which never changes). A :class:`Route` maps
contiguous ranges of logic partitions to physical partitions (streams, queues, Kafka
topics, NATS subjects). Routes are versioned: version 1 is created with ``N`` physical
partitions, and every later version is exactly one change of the one before:

* ``split(p, at)``: physical partition ``p`` is closed; its range ``[start, stop)``
  goes to two new partitions, ``[start, at)`` and ``[at, stop)``.
* ``merge(a, b)``: two partitions with adjacent ranges are closed; one new partition
  takes the joined range.
* ``move(p)``: ``p`` is closed; a new partition takes its range unchanged (to another
  server, or off a full one).

The constraints of the QMQ design hold by construction and are checked by
:func:`check_successor`: versions are contiguous, a version is one change, each
physical partition owns one contiguous range, ranges cover every logic partition
exactly once, and a physical partition id is never reused.

This module does no I/O: the route stores keep routes as the JSON of
:meth:`Route.to_json`, :class:`~msgpatterns.ordering.OrderedTopic` drives it.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from msgpatterns.ordering.errors import RouteError

__all__ = ["ChangeKind", "Route", "Segment", "check_successor", "initial_route"]

#: The kinds of route change.
ChangeKind = Literal["create", "split", "merge", "move"]

_KINDS = ("create", "split", "merge", "move")


@dataclass(frozen=True, slots=True)
class Segment:
    """Physical partition ``physical`` owns logic partitions ``[start, stop)``."""

    physical: int
    start: int
    stop: int

    @property
    def logic(self) -> range:
        """The logic partitions of this segment."""
        return range(self.start, self.stop)


@dataclass(frozen=True)
class Route:
    """One version of a topic's route: which physical partition owns which logic range.

    ``kind``, ``closed`` and ``opened`` describe the change that made this version from
    the one before (version 1: ``create``, nothing closed, every partition opened). A
    partition in ``opened`` may be consumed only after every partition in ``closed``
    has been consumed to its command message.
    """

    version: int
    logic_partitions: int
    segments: tuple[Segment, ...]
    kind: ChangeKind = "create"
    closed: tuple[int, ...] = ()
    opened: tuple[int, ...] = ()
    next_physical: int = 0
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_route(self)
        object.__setattr__(self, "_starts", tuple(s.start for s in self.segments))

    # -- reading ------------------------------------------------------------------

    @property
    def physicals(self) -> tuple[int, ...]:
        """The open physical partitions of this version, in logic-range order."""
        return tuple(s.physical for s in self.segments)

    def physical_of(self, logic: int) -> int:
        """The physical partition that owns logic partition ``logic``."""
        if not 0 <= logic < self.logic_partitions:
            raise RouteError(f"logic partition {logic} is outside 0..{self.logic_partitions - 1}")
        return self.segments[bisect_right(self._starts, logic) - 1].physical

    def table(self) -> list[int]:
        """The physical partition of every logic partition (index = logic partition)."""
        out: list[int] = []
        for s in self.segments:
            out.extend([s.physical] * (s.stop - s.start))
        return out

    def segment(self, physical: int) -> Segment:
        """The segment of open partition ``physical``; RouteError when it is not open."""
        for s in self.segments:
            if s.physical == physical:
                return s
        raise RouteError(
            f"physical partition {physical} is not open in route version {self.version} "
            f"(open: {list(self.physicals)})")

    # -- changes (each returns the next version) ------------------------------------

    def split(self, physical: int, at: int | None = None) -> Route:
        """Close ``physical``; two new partitions take ``[start, at)`` and ``[at, stop)``.

        ``at`` defaults to the middle of the range; a range of one logic partition
        cannot be split.
        """
        seg = self.segment(physical)
        if seg.stop - seg.start < 2:
            raise RouteError(f"physical partition {physical} owns one logic partition: "
                             "it cannot be split")
        cut = (seg.start + seg.stop) // 2 if at is None else at
        if isinstance(cut, bool) or not isinstance(cut, int) or not seg.start < cut < seg.stop:
            raise RouteError(f"split point must be an int strictly inside "
                             f"[{seg.start}, {seg.stop}), got {at!r}")
        low, high = self.next_physical, self.next_physical + 1
        parts = [Segment(low, seg.start, cut), Segment(high, cut, seg.stop)]
        return self._next("split", (physical,), (low, high), self._replace([seg], parts),
                          self.next_physical + 2)

    def merge(self, a: int, b: int) -> Route:
        """Close ``a`` and ``b`` (adjacent ranges); one new partition takes both."""
        if a == b:
            raise RouteError("merge needs two different physical partitions")
        first, second = sorted((self.segment(a), self.segment(b)), key=lambda s: s.start)
        if first.stop != second.start:
            raise RouteError(
                f"only adjacent ranges merge: {first.physical} owns "
                f"[{first.start}, {first.stop}), {second.physical} owns "
                f"[{second.start}, {second.stop})")
        new = self.next_physical
        joined = [Segment(new, first.start, second.stop)]
        return self._next("merge", (first.physical, second.physical), (new,),
                          self._replace([first, second], joined), new + 1)

    def move(self, physical: int) -> Route:
        """Close ``physical``; a new partition takes its range unchanged."""
        seg = self.segment(physical)
        new = self.next_physical
        return self._next("move", (physical,), (new,),
                          self._replace([seg], [Segment(new, seg.start, seg.stop)]), new + 1)

    def _replace(self, old: list[Segment], new: list[Segment]) -> tuple[Segment, ...]:
        kept = [s for s in self.segments if s not in old]
        return tuple(sorted(kept + new, key=lambda s: s.start))

    def _next(self, kind: ChangeKind, closed: tuple[int, ...], opened: tuple[int, ...],
              segments: tuple[Segment, ...], next_physical: int) -> Route:
        return Route(self.version + 1, self.logic_partitions, segments, kind, closed,
                     opened, next_physical)

    # -- storage --------------------------------------------------------------------

    def to_json(self) -> str:
        """The route as compact JSON (what the route stores keep)."""
        return json.dumps({
            "version": self.version,
            "logic_partitions": self.logic_partitions,
            "segments": [[s.physical, s.start, s.stop] for s in self.segments],
            "kind": self.kind,
            "closed": list(self.closed),
            "opened": list(self.opened),
            "next_physical": self.next_physical,
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Route:
        """Parse :meth:`to_json`'s output; RouteError on anything else."""
        try:
            data = json.loads(text)
            return cls(
                version=_int(data["version"]),
                logic_partitions=_int(data["logic_partitions"]),
                segments=tuple(Segment(_int(p), _int(a), _int(b))
                               for p, a, b in data["segments"]),
                kind=_kind(data["kind"]),
                closed=tuple(_int(p) for p in data["closed"]),
                opened=tuple(_int(p) for p in data["opened"]),
                next_physical=_int(data["next_physical"]),
            )
        except RouteError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise RouteError(f"not a stored route: {exc}") from exc

    def describe(self) -> str:
        """One line for humans: ``v3 split 1 -> 4,5``."""
        if self.kind == "create":
            return f"v{self.version} create {len(self.segments)} partition(s)"
        closed = ",".join(map(str, self.closed))
        opened = ",".join(map(str, self.opened))
        return f"v{self.version} {self.kind} {closed} -> {opened}"


def initial_route(physical: int, logic_partitions: int = 1024) -> Route:
    """Version 1: ``physical`` partitions (ids ``0..physical-1``) over equal ranges."""
    if isinstance(physical, bool) or not isinstance(physical, int) or physical < 1:
        raise RouteError(f"physical must be an int of at least 1, got {physical!r}")
    if (isinstance(logic_partitions, bool) or not isinstance(logic_partitions, int)
            or logic_partitions < physical):
        raise RouteError(f"logic_partitions must be an int of at least physical "
                         f"({physical}), got {logic_partitions!r}")
    bounds = [i * logic_partitions // physical for i in range(physical + 1)]
    segments = tuple(Segment(i, bounds[i], bounds[i + 1]) for i in range(physical))
    return Route(1, logic_partitions, segments, "create", (), tuple(range(physical)),
                 physical)


def check_successor(prev: Route, new: Route) -> None:
    """Raise RouteError unless ``new`` is exactly one change after ``prev``.

    Versions are contiguous, the logic partition count never changes, the closed
    partitions were open in ``prev``, the opened ones are new ids, and the logic ranges
    of the opened partitions are exactly those of the closed ones.
    """
    if new.version != prev.version + 1:
        raise RouteError(f"route versions are contiguous: v{prev.version} cannot be "
                         f"followed by v{new.version}")
    if new.logic_partitions != prev.logic_partitions:
        raise RouteError("the number of logic partitions never changes")
    if new.kind == "create" or not new.closed or not new.opened:
        raise RouteError(f"v{new.version} is not a change (kind {new.kind})")
    before = {s.physical: s for s in prev.segments}
    after = {s.physical: s for s in new.segments}
    if any(p not in before for p in new.closed) or any(p in after for p in new.closed):
        raise RouteError(f"v{new.version} closes partitions that were not open")
    if any(p < prev.next_physical or p not in after for p in new.opened):
        raise RouteError(f"v{new.version} opens partition ids that are not new")
    unchanged = set(before) - set(new.closed)
    if unchanged != set(after) - set(new.opened) or any(
            before[p] != after[p] for p in unchanged):
        raise RouteError(f"v{new.version} changes more than its closed partitions")
    closed_logic = sorted(i for p in new.closed for i in before[p].logic)
    opened_logic = sorted(i for p in new.opened for i in after[p].logic)
    if closed_logic != opened_logic:
        raise RouteError(f"v{new.version} does not hand the closed ranges to the opened")


def predecessors(history: Iterable[Route]) -> Mapping[int, tuple[int, tuple[int, ...]]]:
    """For every physical partition ever opened: (the version that opened it, the
    partitions that version closed). A partition may be consumed once each of those
    has been consumed to that version's command message."""
    out: dict[int, tuple[int, tuple[int, ...]]] = {}
    for route in history:
        for p in route.opened:
            out[p] = (route.version, route.closed)
    return out


def closed_by(history: Iterable[Route]) -> Mapping[int, int]:
    """For every closed physical partition: the version whose change closed it."""
    return {p: route.version for route in history for p in route.closed}


def _check_route(route: Route) -> None:
    if route.version < 1 or route.logic_partitions < 1:
        raise RouteError(f"invalid route version {route.version} / logic partitions "
                         f"{route.logic_partitions}")
    if route.kind not in _KINDS:
        raise RouteError(f"unknown route change {route.kind!r}")
    position = 0
    seen: set[int] = set()
    for s in route.segments:
        if s.start != position or s.stop <= s.start:
            raise RouteError("logic ranges must be contiguous, ordered and non-empty")
        if s.physical in seen or not 0 <= s.physical < route.next_physical:
            raise RouteError(f"physical partition {s.physical} is repeated or not below "
                             f"next_physical {route.next_physical}")
        seen.add(s.physical)
        position = s.stop
    if position != route.logic_partitions:
        raise RouteError(f"the ranges cover {position} of {route.logic_partitions} "
                         "logic partitions")


def _int(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise RouteError(f"expected an int in a stored route, got {value!r}")
    return value


def _kind(value: Any) -> ChangeKind:
    if value not in _KINDS:
        raise RouteError(f"unknown route change {value!r}")
    kind: ChangeKind = value
    return kind
