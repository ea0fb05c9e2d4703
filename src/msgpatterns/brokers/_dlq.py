"""The dead-letter operations every adapter offers (``msgpatterns dlq`` drives them)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Protocol, runtime_checkable

from msgpatterns.deadletter import DeadLetter

__all__ = ["DeadLetterAdmin", "selected"]


@runtime_checkable
class DeadLetterAdmin(Protocol):
    """Inspect, replay and purge a topic's dead letters.

    ``group=None`` means every group's dead letters; ``ids=None`` means all of them.
    Replay sends each message back with its attempt count reset: to the group that
    dead-lettered it (``to_topic=False``, other groups do not see it again) or to the
    original topic for every group (``to_topic=True``). A dead letter is removed only
    after its replay was confirmed by the broker.
    """

    def list_dead_letters(self, topic: str, group: str | None = None, *,
                          limit: int | None = None) -> list[DeadLetter]: ...

    def replay_dead_letters(self, topic: str, group: str | None = None,
                            ids: Collection[str] | None = None, *,
                            to_topic: bool = False) -> int: ...

    def purge_dead_letters(self, topic: str, group: str | None = None,
                           ids: Collection[str] | None = None) -> int: ...

    def close(self) -> None: ...


def selected(record: DeadLetter, group: str | None, ids: Collection[str] | None) -> bool:
    """True if ``record`` belongs to ``group`` (any group if None) and is one of ``ids``
    (every record if None)."""
    if group is not None and record.group and record.group != group:
        return False
    return ids is None or record.id in ids
