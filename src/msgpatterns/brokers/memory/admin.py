"""InMemoryDeadLetters: the dead-letter admin of the in-memory fake.

The fake keeps dead letters in :attr:`InMemoryBroker.dead_letters
<msgpatterns.brokers.InMemoryBroker.dead_letters>`; the admin lists them by topic and
group, replays them (to the group that dead-lettered them, or to the topic for every
group) with attempts reset, and purges them. A replayed or purged record leaves
``dead_letters``.
"""

from __future__ import annotations

from collections.abc import Sequence

from msgpatterns.brokers.admin.base import ScannedDeadLetters
from msgpatterns.brokers.memory.broker import InMemoryBroker
from msgpatterns.deadletter import DeadLetter

__all__ = ["InMemoryDeadLetters"]


class InMemoryDeadLetters(ScannedDeadLetters):
    """List, replay and purge the dead letters of an :class:`InMemoryBroker`."""

    def __init__(self, broker: InMemoryBroker) -> None:
        self._broker = broker

    def knows(self, topic: str, group: str | None = None) -> bool:
        return self._broker.knows_topic(topic)

    def _scan(self, topic: str) -> list[DeadLetter]:
        return self._broker.dead_letters_of(topic)

    def _replay(self, topic: str, record: DeadLetter, owner: str | None) -> None:
        self._broker.replay_dead_letter(record, topic, owner)

    def _remove(self, topic: str, records: Sequence[DeadLetter]) -> None:
        self._broker.forget_dead_letters(records)

    def __repr__(self) -> str:
        return f"InMemoryDeadLetters({self._broker!r})"
