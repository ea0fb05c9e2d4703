"""InMemoryBroker: a faithful in-process fake of an at-least-once broker.

It behaves like a real broker, not like a stub: every consumer group gets every
message; a delivery that is not acked within the visibility timeout, or is nacked,
comes back with ``attempt + 1`` (a timed-out delivery - its consumer died - goes back
to the head of the queue, in publish order, before later messages, as on real
brokers; a nacked one to the tail); nack delays and timeouts run on a virtual clock that
tests can jump forward; dead letters are kept with their records. Seeded fault
injection reproduces what real networks do: duplicate deliveries, reordering within
a window, and acks lost on the way back (the message is redelivered later).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from msgpatterns.brokers import codec
from msgpatterns.brokers._adapter import BrokerAdapter, admin_for
from msgpatterns.brokers._batch import outgoing
from msgpatterns.brokers.admin.base import DeadLetterAdmin
from msgpatterns.brokers.memory._state import (
    Entry,
    Lane,
    Picked,
    Receipt,
    drop_settled_leases,
)
from msgpatterns.deadletter import DeadLetter
from msgpatterns.delivery import Delivery, receipt_of
from msgpatterns.errors import MAX_DURATION, ConfigurationError, seconds
from msgpatterns.message import Message

__all__ = ["BrokerEvent", "BrokerStats", "InMemoryBroker", "VirtualClock"]

#: Named in the error for a message this adapter did not deliver.
_OWNER = "this InMemoryBroker"

log = logging.getLogger("msgpatterns.brokers.memory")


class VirtualClock:
    """Wall-clock time plus the jumps a test asked for. Thread-safe; never goes back,
    and never leaves the finite range: a jump past ``MAX_DURATION`` from now is refused
    with :class:`~msgpatterns.errors.ConfigurationError`."""

    def __init__(self, start: float | None = None) -> None:
        base = time.time()
        self._offset = 0.0 if start is None else start - base
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.time() + self._offset

    def advance(self, seconds: float) -> None:
        """Jump ``seconds`` forward (a negative, NaN, infinite or huge jump is refused)."""
        step = _duration(seconds, "advance")
        with self._lock:
            self._offset += step

    def advance_to(self, when: float) -> None:
        """Jump to ``when`` if it lies in the future (a non-finite or absurdly distant
        ``when`` is refused)."""
        if not isinstance(when, (int, float)) or not math.isfinite(when) \
                or when - time.time() - self._offset > MAX_DURATION:
            raise ConfigurationError(f"advance_to needs a finite, reachable time, got {when!r}")
        with self._lock:
            ahead = when - (time.time() + self._offset)
            if ahead > 0:
                self._offset += ahead


def _duration(value: object, what: str) -> float:
    """``value`` as seconds, refused with ConfigurationError unless a finite, bounded,
    non-negative duration: the virtual clock and delay heap must stay finite."""
    try:
        result = seconds(value)  # type: ignore[arg-type]
    except ConfigurationError as exc:
        raise ConfigurationError(f"{what}: {exc}") from None
    return result or 0.0


@dataclass(frozen=True, slots=True)
class BrokerEvent:
    """One thing that happened to a delivery, for assertions and debugging."""

    kind: str  # publish | deliver | ack | lost-ack | nack | dead | duplicate | timeout
    message_id: str | None
    group: str
    attempt: int
    at: float
    delay: float = 0.0


@dataclass
class BrokerStats:
    """Counters of what the broker did (all groups)."""

    published: int = 0
    delivered: int = 0
    redelivered: int = 0
    duplicates: int = 0
    acks: int = 0
    lost_acks: int = 0
    stale_acks: int = 0
    double_acks: int = 0
    nacks: int = 0
    timeouts: int = 0
    dead_letters: int = 0


class InMemoryBroker(BrokerAdapter):
    """An in-process broker with real at-least-once semantics and fault injection.

    Args:
        seed: seeds the fault-injection random generator (and message ids).
        duplicate_rate: probability that a delivery is followed by a duplicate copy.
        reorder_window: a fetch picks at random among the first ``reorder_window``
            ready messages (0 or 1: FIFO).
        lost_ack_rate: probability that an ack is lost: the message stays unacked and
            is redelivered after ``visibility_timeout``.
        visibility_timeout: seconds (virtual) a delivery may stay unacked before the
            broker redelivers it.
        record_history: keep a :class:`BrokerEvent` log in :attr:`history`.

    For assertions: :attr:`acked`, :attr:`pending`, :attr:`dead_letters`,
    :attr:`stats`, :attr:`history`.
    """

    def __init__(
        self,
        *,
        seed: int | None = None,
        duplicate_rate: float = 0.0,
        reorder_window: int = 0,
        lost_ack_rate: float = 0.0,
        visibility_timeout: float = 900.0,
        clock: VirtualClock | None = None,
        record_history: bool = True,
    ) -> None:
        for name, rate in (("duplicate_rate", duplicate_rate), ("lost_ack_rate", lost_ack_rate)):
            if not 0.0 <= rate < 1.0:
                raise ConfigurationError(f"{name} must be in [0, 1), got {rate}")
        if reorder_window < 0:
            raise ConfigurationError("reorder_window cannot be negative")
        if not _duration(visibility_timeout, "visibility_timeout"):
            raise ConfigurationError("visibility_timeout must be positive")
        self.duplicate_rate = duplicate_rate
        self.reorder_window = reorder_window
        self.lost_ack_rate = lost_ack_rate
        self.visibility_timeout = _duration(visibility_timeout, "visibility_timeout")
        self.clock = clock or VirtualClock()
        self.stats = BrokerStats()
        self.record_history = record_history
        self.history: list[BrokerEvent] = []
        self.published: list[Message] = []
        self._rng = random.Random(seed)
        self._seeded = seed is not None
        self._lock = threading.Lock()  # the condition's lock (taken bare on hot paths)
        self._cond = threading.Condition(self._lock)
        self._topics: dict[str, list[Entry]] = {}
        self._lanes: dict[tuple[str, str], Lane] = {}  # (group, topic) -> lane
        self._uids = itertools.count(1)
        self._tokens = itertools.count(1)
        self._acked: list[Message] = []
        self._dead: list[DeadLetter] = []
        self._closed = False

    # -- publishing -----------------------------------------------------------------

    def publish(self, topic: str, body: Any, *, key: str | None = None,
                headers: Mapping[str, str] | None = None, id: str | None = None) -> str:
        """Publish a message to every group of ``topic``; returns its id.

        Raises ConfigurationError for an empty or non-string topic, BrokerClosed after
        :meth:`close`.
        """
        _check_topic(topic)
        with self._cond:
            self._check_open()
            return self._append(topic, body, key, headers, id)

    def _publish(self, topic: str, payload: bytes, key: str | None,
                 headers: Mapping[str, str]) -> str:
        return self.publish(topic, payload, key=key, headers=headers)

    def publish_many(self, topic: str, items: Iterable[Any]) -> list[str]:
        """Publish ``items`` (bodies, or :class:`~msgpatterns.brokers.Outgoing` with key
        and headers) to every group of ``topic``; returns their ids in order. All or
        nothing: the batch is appended at once (no fetch sees part of it)."""
        _check_topic(topic)
        batch = outgoing(items)
        with self._cond:
            self._check_open()
            return [self._append(topic, item.body, item.key, item.headers, None)
                    for item in batch]

    def _append(self, topic: str, body: Any, key: str | None,
                headers: Mapping[str, str] | None, id: str | None) -> str:
        """Append one message (under the lock); returns its id."""
        if id is None:
            id = uuid.UUID(int=self._rng.getrandbits(128), version=4).hex if self._seeded \
                else uuid.uuid4().hex
        log_ = self._topics.setdefault(topic, [])
        entry = Entry(
            next(self._uids), id, topic, body, key, dict(headers or {}),
            self.clock.now(), len(log_),
        )
        log_.append(entry)
        for (_, lane_topic), lane in self._lanes.items():
            if lane_topic == topic:
                lane.ready.append(entry)
                lane.entries += 1
        self.stats.published += 1
        self.published.append(self._to_message(entry, entry.headers, 1))
        self._event("publish", entry.id, "", 0)
        self._cond.notify_all()
        return id

    def subscribe(self, topic: str, group: str) -> None:
        """Create ``group`` on ``topic`` now (it otherwise appears on its first fetch and
        starts from the earliest message)."""
        _check_topic(topic)
        with self._cond:
            self._check_open()
            self._lane(group, topic)

    # -- Broker protocol ------------------------------------------------------------

    def now(self) -> float:
        return self.clock.now()

    def _fetch_messages(self, topics: list[str], group: str, max_messages: int,
                       timeout: float) -> list[Message]:
        """Up to ``max_messages`` deliveries for ``group``, waiting up to ``timeout``.

        A fetch waiting when :meth:`close` is called returns at once with nothing; a
        fetch after it raises BrokerClosed.
        """
        give_up = time.monotonic() + _duration(timeout, "fetch timeout")
        picked: list[Picked] = []
        with self._cond:
            self._check_open()
            lanes = [(t, self._lane(group, t)) for t in topics]
            while True:
                now = self.clock.now()
                for topic, lane in lanes:
                    self._promote(group, lane, now)
                    if len(lane.leases) > 2 * len(lane.inflight) + 256:
                        drop_settled_leases(lane)
                    if lane.ready and len(picked) < max_messages:
                        self._deliver(group, topic, lane, now, max_messages, picked)
                if picked or self._closed:
                    break
                remaining = give_up - time.monotonic()
                if remaining <= 0:
                    break
                due = self._next_due(lanes)
                wait = remaining if due is None else min(remaining, max(due - now, 0.0005))
                self._cond.wait(wait)
        # The messages are built outside the lock (acks of other threads go on).
        return [
            Message(entry.body, id=entry.id, key=entry.key, topic=entry.topic,
                    headers=headers, timestamp=entry.timestamp, attempt=attempt,
                    partition=0, offset=entry.offset, delivery=Delivery(receipt))
            for entry, headers, attempt, receipt in picked
        ]

    def ack(self, message: Message) -> None:
        receipt = message.delivery.receipt
        if type(receipt) is not Receipt:
            receipt = receipt_of(message, Receipt, _OWNER)
        group, topic, uid, token = receipt
        with self._lock:  # the hot path: the bare lock (an ack wakes nobody)
            if self._closed:
                self._check_open()
            lane = self._lanes[(group, topic)]
            done = lane.done.get(uid)
            if done is not None:
                if done == ("acked", token):
                    self.stats.double_acks += 1
                    log.warning("message %s acked twice by the same delivery", message.id)
                else:
                    self.stats.stale_acks += 1
                return
            if self.lost_ack_rate and self._rng.random() < self.lost_ack_rate:
                self.stats.lost_acks += 1
                self._event("lost-ack", message.id, group, message.attempt)
                return
            lane.inflight.pop(uid, None)
            lane.done[uid] = ("acked", token)
            self.stats.acks += 1
            self._acked.append(message)
            if self.record_history:
                self._event("ack", message.id, group, message.attempt)

    def nack(self, message: Message, delay: float = 0.0) -> None:
        """Redeliver after ``delay`` seconds (virtual). A negative, NaN, infinite or
        huge delay raises ConfigurationError and changes nothing."""
        delay = _duration(delay, "nack delay")
        receipt = receipt_of(message, Receipt, _OWNER)
        with self._cond:
            self._check_open()
            lane = self._lanes[(receipt.group, receipt.topic)]
            held = lane.inflight.get(receipt.uid)
            if held is None or held[0] != receipt.token or receipt.uid in lane.done:
                return  # stale: redelivered or settled since
            entry = held[2]
            del lane.inflight[receipt.uid]
            lane.headers[receipt.uid] = dict(message.headers)
            self.stats.nacks += 1
            self._event("nack", message.id, receipt.group, message.attempt, delay)
            if delay > 0:
                heapq.heappush(lane.delayed, (self.clock.now() + delay, entry.uid, entry))
            else:
                lane.ready.append(entry)
            self._cond.notify_all()

    def dead_letter(self, message: Message, record: DeadLetter) -> None:
        receipt = receipt_of(message, Receipt, _OWNER)
        with self._cond:
            self._check_open()
            lane = self._lanes[(receipt.group, receipt.topic)]
            if receipt.uid in lane.done:
                return
            lane.inflight.pop(receipt.uid, None)
            lane.done[receipt.uid] = ("dead", receipt.token)
            self._dead.append(record)
            self.stats.dead_letters += 1
            self._event("dead", message.id, receipt.group, message.attempt)
            self._cond.notify_all()

    # -- virtual time ---------------------------------------------------------------

    def next_due(self, topics: Sequence[str], group: str) -> float | None:
        with self._cond:
            self._check_open()
            return self._next_due([(t, self._lane(group, t)) for t in topics])

    def advance_to(self, when: float) -> None:
        with self._cond:
            self._check_open()
            self.clock.advance_to(when)
            self._cond.notify_all()

    def advance(self, seconds: float) -> None:
        """Move the virtual clock ``seconds`` forward."""
        with self._cond:
            self._check_open()
            self.clock.advance(seconds)
            self._cond.notify_all()

    # -- assertions -----------------------------------------------------------------

    @property
    def acked(self) -> list[Message]:
        """Deliveries whose ack reached the broker (lost acks excluded), in order."""
        with self._cond:
            return list(self._acked)

    @property
    def dead_letters(self) -> list[DeadLetter]:
        with self._cond:
            return list(self._dead)

    @property
    def pending(self) -> int:
        """Messages not yet acked or dead-lettered, over all groups (a topic nobody
        consumes counts all its messages)."""
        with self._cond:
            total = 0
            for topic, entries in self._topics.items():
                lanes = [lane for (_, t), lane in self._lanes.items() if t == topic]
                if not lanes:
                    total += len(entries)
                total += sum(lane.entries - len(lane.done) for lane in lanes)
            return total

    def pending_for(self, group: str, topic: str | None = None) -> int:
        """Messages of ``group`` (on ``topic``, or all its topics) not yet settled."""
        with self._cond:
            return sum(
                lane.entries - len(lane.done)
                for (g, t), lane in self._lanes.items()
                if g == group and (topic is None or t == topic)
            )

    def in_flight(self, group: str | None = None) -> int:
        """Deliveries handed out and not yet acked, nacked or timed out."""
        with self._cond:
            return sum(
                len(lane.inflight) for (g, _), lane in self._lanes.items()
                if group is None or g == group
            )

    def close(self) -> None:
        """Close the broker; idempotent.

        A fetch waiting now returns at once with nothing; afterwards every broker
        operation (``publish``, ``subscribe``, ``fetch``, ``ack``, ``nack``,
        ``dead_letter``, ``next_due``, ``advance``/``advance_to``) raises
        :class:`~msgpatterns.errors.BrokerClosed` at once. The assertion views
        (``acked``, ``pending``, ``dead_letters``, ``stats``, ``history``) and ``now()``
        keep working.
        """
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    def dead_letter_admin(self) -> DeadLetterAdmin:
        """List, replay and purge :attr:`dead_letters` by topic and group
        (:class:`~msgpatterns.brokers.memory.admin.InMemoryDeadLetters`)."""
        return admin_for("msgpatterns.brokers.memory.admin:InMemoryDeadLetters", self)

    # -- steps the dead-letter admin builds on ----------------------------------------

    def knows_topic(self, topic: str) -> bool:
        """True when ``topic`` has had a message or has a dead letter."""
        with self._cond:
            return topic in self._topics or any(r.message.topic == topic
                                                for r in self._dead)

    def dead_letters_of(self, topic: str) -> list[DeadLetter]:
        """The dead letters of ``topic``, oldest first."""
        with self._cond:
            self._check_open()
            return [r for r in self._dead if r.message.topic == topic]

    def replay_dead_letter(self, record: DeadLetter, topic: str, owner: str | None) -> None:
        """Send ``record``'s message back with its attempts reset (its user headers
        only) - to ``owner``'s redeliveries, or to ``topic`` for every group when None -
        and drop the record; nothing when it was replayed or purged meanwhile."""
        m = record.message
        headers = codec.user_headers(record)
        with self._cond:
            self._check_open()
            if not self._forget([record]):
                return  # replayed or purged meanwhile
            if owner is None:
                self._append(topic, m.body, m.key, headers, m.id)
                return
            lane = self._lane(owner, topic)
            lane.ready.append(Entry(next(self._uids), m.id or "", topic, m.body, m.key,
                                    headers, m.timestamp or self.clock.now(),
                                    m.offset or 0))
            lane.entries += 1
            self._event("replay", m.id, owner, 0)
            self._cond.notify_all()

    def forget_dead_letters(self, records: Sequence[DeadLetter]) -> None:
        """Drop ``records`` from :attr:`dead_letters`."""
        with self._cond:
            self._check_open()
            self._forget(records)

    def __repr__(self) -> str:
        return "InMemoryBroker()"

    # -- internals --------------------------------------------------------------------

    def _forget(self, records: Sequence[DeadLetter]) -> bool:
        """Drop ``records`` from the dead letters (lock held); False when none of them
        was there any more."""
        doomed = {id(r) for r in records}
        kept = [r for r in self._dead if id(r) not in doomed]
        found = len(kept) != len(self._dead)
        self._dead[:] = kept
        return found

    def _lane(self, group: str, topic: str) -> Lane:
        lane = self._lanes.get((group, topic))
        if lane is None:
            lane = Lane()
            entries = self._topics.setdefault(topic, [])
            lane.ready.extend(entries)
            lane.entries = len(entries)
            self._lanes[(group, topic)] = lane
        return lane

    def _promote(self, group: str, lane: Lane, now: float) -> None:
        while lane.delayed and lane.delayed[0][0] <= now:
            lane.ready.append(heapq.heappop(lane.delayed)[2])
        timed_out: list[Entry] = []
        while lane.leases and lane.leases[0][0] <= now:
            _, token, uid = heapq.heappop(lane.leases)
            held = lane.inflight.get(uid)
            if held is not None and held[0] == token:
                del lane.inflight[uid]
                timed_out.append(held[2])
                self.stats.timeouts += 1
                self._event("timeout", held[2].id, group, lane.deliveries[uid])
        if timed_out:  # like a real broker: a dead consumer's deliveries come back first
            timed_out.sort(key=lambda entry: (entry.offset, entry.uid))
            lane.ready.extendleft(reversed(timed_out))

    def _next_due(self, lanes: Sequence[tuple[str, Lane]]) -> float | None:
        due: float | None = None
        for _, lane in lanes:
            if lane.ready:
                return self.clock.now()
            candidates = []
            if lane.delayed:
                candidates.append(lane.delayed[0][0])
            while lane.leases and lane.inflight.get(lane.leases[0][2], (None,))[0] != \
                    lane.leases[0][1]:
                heapq.heappop(lane.leases)  # drop leases of settled deliveries
            if lane.leases:
                candidates.append(lane.leases[0][0])
            for c in candidates:
                due = c if due is None else min(due, c)
        return due

    def _deliver(self, group: str, topic: str, lane: Lane, now: float, most: int,
                 out: list[Picked]) -> None:
        """Deliver ready messages of ``lane`` into ``out`` until it holds ``most`` (lock
        held; the caller builds their messages)."""
        ready, deliveries, inflight = lane.ready, lane.deliveries, lane.inflight
        leases, redelivered_headers, stats = lane.leases, lane.headers, self.stats
        tokens, rng, deadline = self._tokens, self._rng, now + self.visibility_timeout
        while ready and len(out) < most:
            if self.reorder_window > 1 and len(ready) > 1:
                index = rng.randrange(min(self.reorder_window, len(ready)))
                entry = ready[index]
                del ready[index]
            else:
                entry = ready.popleft()
            uid = entry.uid
            if uid in lane.done:
                # Settled by a late ack (or dead letter) of a delivery whose visibility
                # timeout had put it back: that settlement stands (as a late XACK does
                # on Redis), so this copy is dropped - delivered, every ack of it would
                # be stale and it would time out and come back forever.
                continue
            attempt = deliveries.get(uid, 0) + 1
            deliveries[uid] = attempt
            token = next(tokens)
            inflight[uid] = (token, deadline, entry)
            heapq.heappush(leases, (deadline, token, uid))
            stats.delivered += 1
            if attempt > 1:
                stats.redelivered += 1
            if self.record_history:
                self._event("deliver", entry.id, group, attempt)
            if self.duplicate_rate and rng.random() < self.duplicate_rate:
                copy = Entry(
                    next(self._uids), entry.id, entry.topic, entry.body, entry.key,
                    entry.headers, entry.timestamp, entry.offset,
                )
                ready.append(copy)
                lane.entries += 1
                stats.duplicates += 1
                self._event("duplicate", entry.id, group, attempt)
            # (headers dicts are replaced, never changed: safe to copy after the lock)
            out.append((entry, redelivered_headers.get(uid, entry.headers), attempt,
                        Receipt(group, topic, uid, token)))

    @staticmethod
    def _to_message(entry: Entry, headers: Mapping[str, str], attempt: int) -> Message:
        return Message(
            entry.body,
            id=entry.id,
            key=entry.key,
            topic=entry.topic,
            headers=headers,
            timestamp=entry.timestamp,
            attempt=attempt,
            partition=0,
            offset=entry.offset,
        )

    def _event(self, kind: str, message_id: str | None, group: str, attempt: int,
               delay: float = 0.0) -> None:
        if self.record_history:
            self.history.append(
                BrokerEvent(kind, message_id, group, attempt, self.clock.now(), delay)
            )


def _check_topic(topic: object) -> None:
    if not isinstance(topic, str) or not topic:
        raise ConfigurationError(f"topic must be a non-empty string, got {topic!r}")
