"""InMemoryDeadLetters: the dead-letter admin of the in-memory fake.

The fake keeps dead letters in :attr:`InMemoryBroker.dead_letters
<msgpatterns.brokers.InMemoryBroker.dead_letters>`; the admin lists them by topic and
group, replays them (to the group that dead-lettered them, or to the topic for every
group) with attempts reset, and purges them. A replayed or purged record leaves
``dead_letters``.
"""

from __future__ import annotations

from collections.abc import Sequence

from msgpatterns.brokers import _codec as codec
from msgpatterns.brokers.admin.base import ScannedDeadLetters
from msgpatterns.brokers.memory import InMemoryBroker, _Entry
from msgpatterns.deadletter import DeadLetter

__all__ = ["InMemoryDeadLetters"]


class InMemoryDeadLetters(ScannedDeadLetters):
    """List, replay and purge the dead letters of an :class:`InMemoryBroker`."""

    def __init__(self, broker: InMemoryBroker) -> None:
        self._broker = broker

    def knows(self, topic: str, group: str | None = None) -> bool:
        b = self._broker
        with b._cond:
            return topic in b._topics or any(r.message.topic == topic for r in b._dead)

    def _scan(self, topic: str) -> list[DeadLetter]:
        b = self._broker
        with b._cond:
            b._check_open()
            return [r for r in b._dead if r.message.topic == topic]

    def _replay(self, topic: str, record: DeadLetter, owner: str | None) -> None:
        b = self._broker
        m = record.message
        headers = codec.user_headers(record)
        with b._cond:
            b._check_open()
            if not self._forget([record]):
                return  # replayed or purged meanwhile
            if owner is None:
                b._append(topic, m.body, m.key, headers, m.id)
                return
            lane = b._lane(owner, topic)
            lane.ready.append(_Entry(next(b._uids), m.id or "", topic, m.body, m.key, headers,
                                     m.timestamp or b.clock.now(), m.offset or 0))
            lane.entries += 1
            b._event("replay", m.id, owner, 0)
            b._cond.notify_all()

    def _remove(self, topic: str, records: Sequence[DeadLetter]) -> None:
        with self._broker._cond:
            self._broker._check_open()
            self._forget(records)

    def _forget(self, records: Sequence[DeadLetter]) -> bool:
        """Drop ``records`` from the broker's dead letters (lock held); False when none
        of them was there any more."""
        b = self._broker
        doomed = {id(r) for r in records}
        kept = [r for r in b._dead if id(r) not in doomed]
        found = len(kept) != len(b._dead)
        b._dead[:] = kept
        return found

    def __repr__(self) -> str:
        return f"InMemoryDeadLetters({self._broker!r})"
