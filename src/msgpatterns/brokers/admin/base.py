"""The :class:`DeadLetterAdmin` protocol and the logic every admin shares.

Which records an operation touches (:func:`selected`), where a replay goes
(:func:`replay_owner`) and the list/replay/purge loops over a store that can be scanned
(:class:`ScannedDeadLetters`) exist once, here; each broker's admin supplies only its
I/O: scan the dead-letter store, send one replay, remove records.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from typing import Protocol, runtime_checkable

from msgpatterns.deadletter import DeadLetter
from msgpatterns.errors import ConfigurationError

__all__ = ["DeadLetterAdmin", "ScannedDeadLetters", "replay_owner", "selected"]


@runtime_checkable
class DeadLetterAdmin(Protocol):
    """Inspect, replay and purge a topic's dead letters.

    ``group=None`` means every group's dead letters; ``ids=None`` means all of them.
    Replay sends each message back with its attempt count reset: to the group that
    dead-lettered it (``to_topic=False``, other groups do not see it again) or to the
    original topic for every group (``to_topic=True``). A dead letter is removed only
    after its replay was confirmed by the broker. :meth:`close` releases what the
    admin opened itself (never the broker it was taken from); admins are context
    managers.
    """

    def list_dead_letters(self, topic: str, group: str | None = None, *,
                          limit: int | None = None) -> list[DeadLetter]:
        """Dead letters of ``topic`` (of ``group``, or every group), oldest first."""
        ...

    def replay_dead_letters(self, topic: str, group: str | None = None,
                            ids: Collection[str] | None = None, *,
                            to_topic: bool = False) -> int:
        """Send the selected dead letters back with attempts reset; how many."""
        ...

    def purge_dead_letters(self, topic: str, group: str | None = None,
                           ids: Collection[str] | None = None) -> int:
        """Delete the selected dead letters; how many."""
        ...

    def knows(self, topic: str, group: str | None = None) -> bool:
        """True when the broker has ``topic`` (for ``group``) or a dead-letter store
        for it: False means a mistyped name rather than an empty store."""
        ...

    def close(self) -> None:
        """Release what the admin opened itself; idempotent."""
        ...


def selected(record: DeadLetter, group: str | None, ids: Collection[str] | None) -> bool:
    """True if ``record`` belongs to ``group`` (any group if None) and is one of ``ids``
    (every record if None)."""
    if group is not None and record.group and record.group != group:
        return False
    return ids is None or record.id in ids


def replay_owner(record: DeadLetter, group: str | None, to_topic: bool) -> str | None:
    """The group a replay of ``record`` goes to: None for the topic (every group), else
    the group that dead-lettered it (or ``group`` for a record that names none); a
    :class:`~msgpatterns.errors.ConfigurationError` when there is none."""
    if to_topic:
        return None
    owner = record.group or group
    if not owner:
        raise ConfigurationError(f"dead letter {record.id} has no group; pass group= "
                                 "or replay to the topic")
    return owner


class ScannedDeadLetters(ABC):
    """A :class:`DeadLetterAdmin` over a dead-letter store that can be read in full.

    Subclasses give the I/O: :meth:`_scan` (every record of the topic, oldest first),
    :meth:`_replay` (send one record back and remove it, removing only once the
    broker confirmed the copy) and :meth:`_remove`.
    """

    def list_dead_letters(self, topic: str, group: str | None = None, *,
                          limit: int | None = None) -> list[DeadLetter]:
        out: list[DeadLetter] = []
        if limit is not None and limit <= 0:
            return out
        for record in self._scan(topic):
            if selected(record, group, None):
                out.append(record)
                if limit is not None and len(out) >= limit:
                    break
        return out

    def replay_dead_letters(self, topic: str, group: str | None = None,
                            ids: Collection[str] | None = None, *,
                            to_topic: bool = False) -> int:
        count = 0
        for record in self._scan(topic):
            if selected(record, group, ids):
                self._replay(topic, record, replay_owner(record, group, to_topic))
                count += 1
        return count

    def purge_dead_letters(self, topic: str, group: str | None = None,
                           ids: Collection[str] | None = None) -> int:
        doomed = [r for r in self._scan(topic) if selected(r, group, ids)]
        if doomed:
            self._remove(topic, doomed)
        return len(doomed)

    def close(self) -> None:  # noqa: B027 - most admins share their broker's connection
        """Nothing to release unless the admin opened a connection of its own."""

    def __enter__(self) -> ScannedDeadLetters:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @abstractmethod
    def _scan(self, topic: str) -> Sequence[DeadLetter]:
        """Every dead letter of ``topic`` still in the store, oldest first."""

    @abstractmethod
    def _replay(self, topic: str, record: DeadLetter, owner: str | None) -> None:
        """Send ``record`` back (to ``owner``'s redeliveries, or the topic when None),
        then remove it from the store."""

    @abstractmethod
    def _remove(self, topic: str, records: Sequence[DeadLetter]) -> None:
        """Remove ``records`` from the store."""
