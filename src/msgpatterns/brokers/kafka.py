"""KafkaBroker: the Broker protocol on Kafka (confluent-kafka).

Topics, for a topic ``T``:

* ``T`` - what producers write to; each consumer group reads it from its committed
  offsets;
* ``T.retry`` - redeliveries: a nacked message is re-produced here with the attempt
  header, the group it is meant for, and the time it is due;
* ``T.DLT`` - dead letters, each with its full record in headers (original topic,
  partition, offset, error, traceback, attempts, failure times).

Create ``T.retry`` and ``T.DLT`` with the same partition count as ``T`` (or let the
cluster auto-create them).

Guarantees:

* Auto-commit is off. The committed offset of a partition is the first offset not yet
  settled: out-of-order acks never commit past an unsettled message, so a crash
  redelivers everything unsettled (at least once).
* A retry or dead letter is produced and confirmed before its offset counts as
  settled: a crash in between duplicates it, never loses it.
* Retries are never early: a retry partition whose next record is not yet due is
  paused (and rewound to that record) until it is. Records meant for another group are
  skipped. Retries behind a later-due record of the same partition wait for it.
* Rebalances: revoked partitions commit their settled prefix, and settlements of
  their in-flight messages are then ignored (the new owner redelivers them).
* The attempt number is durable across retries and restarts (the attempt header).
  Kafka keeps no delivery count, so a redelivery after a crash keeps its attempt.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from msgpatterns import headers as h
from msgpatterns._extras import require
from msgpatterns.brokers import _codec as codec
from msgpatterns.brokers._dlq import selected
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.message import Message

kafka = require("confluent_kafka", "kafka")

__all__ = ["KafkaBroker", "OffsetTracker"]

log = logging.getLogger("msgpatterns.brokers.kafka")

#: Header of a dead-letter-topic marker record: the records it removes, as JSON.
DLQ_REMOVES = h.PREFIX + "dlq-removes"


class OffsetTracker:
    """One partition's delivered offsets and which of them are settled.

    :meth:`position` is the offset to commit: the first delivered offset not yet
    settled, or one past the last delivered when all are. It never passes an
    unsettled offset, whatever order settlements arrive in.
    """

    __slots__ = ("_done", "_last", "_open", "_pending", "committed", "epoch")

    def __init__(self, epoch: int = 0) -> None:
        self.epoch = epoch
        self._pending: deque[int] = deque()  # delivered, in order, up to the position
        self._open: set[int] = set()  # the same offsets, for lookups
        self._done: set[int] = set()  # the settled ones among them
        self._last: int | None = None
        self.committed: int | None = None

    def delivered(self, offset: int) -> None:
        """``offset`` was handed out (offsets arrive in increasing order)."""
        if self._last is not None and offset <= self._last:
            return
        self._pending.append(offset)
        self._open.add(offset)
        self._last = offset

    def settled(self, offset: int) -> None:
        """``offset`` is done (acked, retried or dead-lettered)."""
        if offset in self._open:
            self._done.add(offset)

    def position(self) -> int | None:
        """The offset to commit, or None before the first delivery."""
        while self._pending and self._pending[0] in self._done:
            head = self._pending.popleft()
            self._done.discard(head)
            self._open.discard(head)
        if self._pending:
            return self._pending[0]
        return None if self._last is None else self._last + 1

    @property
    def unsettled(self) -> int:
        """Delivered offsets not settled yet."""
        return len(self._open) - len(self._done)


@dataclass(frozen=True, slots=True)
class _Receipt:
    group: str
    topic: str  # where the record was read (the topic or its retry topic)
    partition: int
    offset: int
    epoch: int


@dataclass
class _Group:
    """One consumer group's client and per-partition state."""

    consumer: Any
    topics: tuple[str, ...]
    retry_topics: dict[str, str]  # retry topic -> topic
    trackers: dict[tuple[str, int], OffsetTracker] = field(default_factory=dict)
    paused: dict[tuple[str, int], float] = field(default_factory=dict)  # -> due time


def _bootstrap(url: str) -> str:
    return url.split("://", 1)[1] if "://" in url else url


class KafkaBroker:
    """The :class:`~msgpatterns.brokers.base.Broker` protocol on Kafka.

    Args:
        bootstrap_or_config: ``host:port[,host:port]``, a ``kafka://`` URL, or a
            librdkafka configuration dict (applied to consumers and the producer).
        consumer_config: extra settings for the group consumers (``group.id``,
            ``enable.auto.commit`` and the rebalance callbacks are set here).
        producer_config: extra settings for the producer.
        producer: a ``confluent_kafka.Producer`` to use instead of creating one.
        retry_suffix, dead_letter_suffix: names of the retry and dead-letter topics.
        delivery_timeout: seconds to wait for a produced record's confirmation.
    """

    def __init__(
        self,
        bootstrap_or_config: str | Mapping[str, Any],
        *,
        consumer_config: Mapping[str, Any] | None = None,
        producer_config: Mapping[str, Any] | None = None,
        producer: Any = None,
        retry_suffix: str = ".retry",
        dead_letter_suffix: str = ".DLT",
        delivery_timeout: float = 30.0,
    ) -> None:
        if isinstance(bootstrap_or_config, str):
            self._base: dict[str, Any] = {
                "bootstrap.servers": _bootstrap(bootstrap_or_config)
            }
        else:
            self._base = dict(bootstrap_or_config)
        self._consumer_config = dict(consumer_config or {})
        self.retry_suffix = retry_suffix
        self.dead_letter_suffix = dead_letter_suffix
        self.delivery_timeout = delivery_timeout
        self._owns_producer = producer is None
        self._producer = producer if producer is not None else kafka.Producer({
            **self._base, "enable.idempotence": True, **(producer_config or {}),
        })
        self._lock = threading.Lock()
        self._groups: dict[str, _Group] = {}
        self._epochs = itertools.count(1)
        self._closed = False

    # -- names ----------------------------------------------------------------------

    def retry_topic(self, topic: str) -> str:
        return topic + self.retry_suffix

    def dead_letter_topic(self, topic: str) -> str:
        return topic + self.dead_letter_suffix

    # -- Broker protocol ------------------------------------------------------------

    def now(self) -> float:
        return time.time()

    def publish(
        self,
        topic: str,
        body: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> str:
        """Produce to ``topic`` and wait for the broker's confirmation; returns the
        message id (kept in a header, stable across retries)."""
        message_id = uuid.uuid4().hex
        self._produce(topic, body_bytes(body), key,
                      codec.wire_headers(headers, message_id=message_id))
        return message_id

    def subscribe(self, topic: str, group: str) -> None:
        """Join ``group`` on ``topic`` now (a fetch does it otherwise)."""
        self._group(group, [topic])

    def fetch(
        self,
        topics: Sequence[str],
        group: str,
        max_messages: int = 1,
        timeout: float = 0.0,
    ) -> list[Message]:
        """Up to ``max_messages`` records of ``topics`` and their due retries, waiting
        up to ``timeout`` seconds. Commits what became safe to commit first."""
        if isinstance(topics, str):
            topics = [topics]
        state = self._group(group, topics)
        self._commit(state, asynchronous=True)
        now = self.now()
        self._resume_due(state, now)
        wait = timeout
        if state.paused:
            wait = min(wait, max(0.0, min(state.paused.values()) - now))
        records = state.consumer.consume(num_messages=max_messages, timeout=wait)
        out: list[Message] = []
        now = self.now()
        for record in records:
            message = self._accept(state, group, record, now)
            if message is not None:
                out.append(message)
        return out

    def ack(self, message: Message) -> None:
        self._settled(self._receipt(message))

    def nack(self, message: Message, delay: float = 0.0) -> None:
        """Produce the retry (original payload, current headers, ``attempt + 1``, due
        in ``delay`` seconds) to ``<topic>.retry``; once confirmed, the record is
        settled."""
        r = self._receipt(message)
        if self._stale(r):
            log.debug("nack of %s ignored: its partition was revoked", message.id)
            return
        wire = codec.redelivery_headers(message, group=r.group, due_at=self.now() + delay)
        self._produce(self.retry_topic(message.topic), body_bytes(message.raw_body),
                      message.key, wire)
        self._settled(r)

    def dead_letter(self, message: Message, record: DeadLetter) -> None:
        """Produce the record to ``<topic>.DLT``; once confirmed, the record is settled."""
        r = self._receipt(message)
        if self._stale(r):
            log.debug("dead letter of %s ignored: its partition was revoked", message.id)
            return
        self._produce(self.dead_letter_topic(message.topic), codec.dead_letter_body(record),
                      message.key, codec.dead_letter_headers(record))
        self._settled(r)

    def commit(self) -> dict[tuple[str, str, int], int]:
        """Commit every group's settled prefix now (synchronously); returns the
        committed position of every assigned partition that has one, by
        ``(group, topic, partition)``."""
        out: dict[tuple[str, str, int], int] = {}
        for group, state in list(self._groups.items()):
            self._commit(state, asynchronous=False)
            with self._lock:
                for (topic, partition), tracker in state.trackers.items():
                    if tracker.committed is not None:
                        out[(group, topic, partition)] = tracker.committed
        return out

    def close(self) -> None:
        """Commit the settled prefixes, leave the groups, flush the producer."""
        if self._closed:
            return
        self._closed = True
        for state in list(self._groups.values()):
            try:
                self._commit(state, asynchronous=False)
            finally:
                state.consumer.close()
        self._groups.clear()
        if self._owns_producer:
            self._producer.flush(self.delivery_timeout)

    # -- dead-letter admin ----------------------------------------------------------

    def list_dead_letters(self, topic: str, group: str | None = None, *,
                          limit: int | None = None) -> list[DeadLetter]:
        """Dead letters of ``topic`` still in ``<topic>.DLT`` (not replayed or purged),
        oldest first per partition."""
        out = [record for record in self._live_dead_letters(topic)
               if selected(record, group, None)]
        return out if limit is None else out[:limit]

    def replay_dead_letters(self, topic: str, group: str | None = None,
                            ids: Collection[str] | None = None, *,
                            to_topic: bool = False) -> int:
        """Re-produce dead letters with attempts reset: to ``<topic>.retry`` for the
        group that dead-lettered them, or to ``topic`` for every group. Each is marked
        removed in the dead-letter topic only after its replay was confirmed."""
        count = 0
        for record in self._live_dead_letters(topic):
            if not selected(record, group, ids):
                continue
            owner = record.group or group
            if to_topic or not owner:
                if not to_topic:
                    raise ValueError(f"dead letter {record.id} has no group; pass group=")
                self._produce(topic, body_bytes(record.message.raw_body), record.message.key,
                              codec.replay_headers(record))
            else:
                wire = codec.replay_headers(record, group=owner)
                wire[h.RETRY_DUE_AT] = repr(self.now())
                self._produce(self.retry_topic(topic), body_bytes(record.message.raw_body),
                              record.message.key, wire)
            self._mark_removed(topic, [record])
            count += 1
        return count

    def purge_dead_letters(self, topic: str, group: str | None = None,
                           ids: Collection[str] | None = None) -> int:
        """Mark dead letters removed (Kafka cannot delete records; retention does)."""
        doomed = [r for r in self._live_dead_letters(topic) if selected(r, group, ids)]
        if doomed:
            self._mark_removed(topic, doomed)
        return len(doomed)

    # -- internals --------------------------------------------------------------------

    def _group(self, group: str, topics: Sequence[str]) -> _Group:
        if self._closed:
            raise RuntimeError("the KafkaBroker is closed")
        state = self._groups.get(group)
        wanted = tuple(topics)
        if state is not None and state.topics == wanted:
            return state
        if state is None:
            consumer = kafka.Consumer({
                **self._base,
                "auto.offset.reset": "earliest",
                **self._consumer_config,
                "group.id": group,
                "enable.auto.commit": False,
                "on_commit": self._on_commit,
            })
            state = _Group(consumer, wanted, {})
            self._groups[group] = state
        state.topics = wanted
        state.retry_topics = {self.retry_topic(t): t for t in wanted}
        self._touch([*wanted, *state.retry_topics])
        subscribed = state  # bound for the callbacks below
        state.consumer.subscribe(
            [*wanted, *state.retry_topics],
            on_assign=lambda consumer, parts: self._on_assign(subscribed, parts),
            on_revoke=lambda consumer, parts: self._on_revoke(subscribed, consumer, parts),
            on_lost=lambda consumer, parts: self._on_revoke(subscribed, None, parts),
        )
        return state

    def _touch(self, topics: Sequence[str]) -> None:
        """Ask for the topics' metadata through the producer, which makes a cluster
        that auto-creates topics create them now, before the subscription looks."""
        for topic in topics:
            try:
                self._producer.list_topics(topic, timeout=self.delivery_timeout)
            except kafka.KafkaException as exc:
                log.debug("metadata for %s: %s", topic, exc)

    def _accept(self, state: _Group, group: str, record: Any, now: float) -> Message | None:
        """The message for ``record``, or None when it is not for this consumer now."""
        error = record.error()
        if error is not None:
            if error.code() != kafka.KafkaError._PARTITION_EOF:
                log.warning("%s: consumer error: %s", group, error)
            return None
        where = (record.topic(), record.partition())
        offset = record.offset()
        with self._lock:
            if where in state.paused:
                return None  # read past a paused retry; re-read after resuming
            tracker = state.trackers.get(where)
            if tracker is None:
                tracker = state.trackers[where] = OffsetTracker(next(self._epochs))
        t = codec.split_transport(record.headers() or [])
        topic = record.topic()
        if topic in state.retry_topics:
            if t.group is not None and t.group != group:
                with self._lock:  # another group's retry: nothing to do here
                    tracker.delivered(offset)
                    tracker.settled(offset)
                return None
            if t.due_at is not None and t.due_at > now:
                self._pause(state, record.topic(), record.partition(), offset, t.due_at)
                return None
            topic = state.retry_topics[topic]
        with self._lock:
            tracker.delivered(offset)
        key = record.key()
        stamp = record.timestamp()
        message = Message(
            record.value() or b"",
            id=t.id or f"{record.topic()}-{record.partition()}-{offset}",
            key=codec.text(key) if key is not None else t.key,
            topic=topic,
            headers=t.headers,
            timestamp=t.timestamp or (stamp[1] / 1000 if stamp[1] > 0 else None),
            attempt=codec.attempt_of(t.headers),
            partition=record.partition(),
            offset=offset,
        )
        message.receipt = _Receipt(group, record.topic(), record.partition(), offset,
                                   tracker.epoch)
        return message

    def _pause(self, state: _Group, topic: str, partition: int, offset: int,
               due: float) -> None:
        """Hold a retry partition at ``offset`` until ``due``."""
        state.consumer.seek(kafka.TopicPartition(topic, partition, offset))
        state.consumer.pause([kafka.TopicPartition(topic, partition)])
        with self._lock:
            state.paused[(topic, partition)] = due

    def _resume_due(self, state: _Group, now: float) -> None:
        with self._lock:
            due = [tp for tp, when in state.paused.items() if when <= now]
            for tp in due:
                del state.paused[tp]
        if due:
            state.consumer.resume([kafka.TopicPartition(t, p) for t, p in due])

    def _on_assign(self, state: _Group, partitions: list[Any]) -> None:
        with self._lock:
            for tp in partitions:
                state.trackers[(tp.topic, tp.partition)] = OffsetTracker(next(self._epochs))
                state.paused.pop((tp.topic, tp.partition), None)

    def _on_revoke(self, state: _Group, consumer: Any, partitions: list[Any]) -> None:
        """Commit the revoked partitions' settled prefix (unless lost) and forget them:
        their in-flight messages' settlements become no-ops."""
        offsets = []
        with self._lock:
            for tp in partitions:
                where = (tp.topic, tp.partition)
                tracker = state.trackers.pop(where, None)
                state.paused.pop(where, None)
                position = None if tracker is None else tracker.position()
                if position is not None and tracker is not None \
                        and position != tracker.committed:
                    offsets.append(kafka.TopicPartition(tp.topic, tp.partition, position))
        if consumer is not None and offsets:
            try:
                consumer.commit(offsets=offsets, asynchronous=False)
            except kafka.KafkaException as exc:
                log.warning("commit on revoke failed (%s); those records will be "
                            "redelivered", exc)

    def _on_commit(self, error: Any, partitions: list[Any]) -> None:
        if error is None or error.code() == kafka.KafkaError._NO_OFFSET:
            return
        log.warning("offset commit failed (%s); retrying on the next fetch", error)
        self._forget_commits(list(self._groups.values()), partitions)

    def _forget_commits(self, states: Sequence[_Group], partitions: Sequence[Any]) -> None:
        """A commit of ``partitions`` failed: the next fetch commits them again."""
        with self._lock:
            for state in states:
                for tp in partitions:
                    found = state.trackers.get((tp.topic, tp.partition))
                    if found is not None:
                        found.committed = None

    def _commit(self, state: _Group, *, asynchronous: bool) -> list[Any]:
        offsets = []
        with self._lock:
            for (topic, partition), tracker in state.trackers.items():
                position = tracker.position()
                if position is not None and position != tracker.committed:
                    offsets.append(kafka.TopicPartition(topic, partition, position))
                    tracker.committed = position
        if offsets:
            try:
                state.consumer.commit(offsets=offsets, asynchronous=asynchronous)
            except kafka.KafkaException as exc:
                log.warning("offset commit failed (%s); retrying on the next fetch", exc)
                self._forget_commits([state], offsets)
                return []
        return offsets

    def _stale(self, r: _Receipt) -> bool:
        state = self._groups.get(r.group)
        with self._lock:
            tracker = None if state is None else state.trackers.get((r.topic, r.partition))
            return tracker is None or tracker.epoch != r.epoch

    def _settled(self, r: _Receipt) -> None:
        state = self._groups.get(r.group)
        with self._lock:
            tracker = None if state is None else state.trackers.get((r.topic, r.partition))
            if tracker is not None and tracker.epoch == r.epoch:
                tracker.settled(r.offset)

    def _produce(self, topic: str, value: bytes, key: str | None,
                 headers: Mapping[str, str]) -> tuple[int, int]:
        """Produce one record and wait for its delivery report; (partition, offset)."""
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def on_delivery(error: Any, produced: Any) -> None:
            outcome["error"], outcome["record"] = error, produced
            done.set()

        self._producer.produce(
            topic, value=value, key=None if key is None else key.encode("utf-8"),
            headers=list(headers.items()), on_delivery=on_delivery,
        )
        give_up = time.monotonic() + self.delivery_timeout
        while not done.is_set():
            if time.monotonic() > give_up:
                raise kafka.KafkaException(
                    kafka.KafkaError(kafka.KafkaError._MSG_TIMED_OUT,
                                     f"no delivery report from {topic}"))
            self._producer.poll(0.05)
        if outcome["error"] is not None:
            raise kafka.KafkaException(outcome["error"])
        produced = outcome["record"]
        return produced.partition(), produced.offset()

    # -- dead-letter topic scanning ---------------------------------------------------

    def _scan_dead_letters(self, topic: str) -> Iterator[tuple[Any, DeadLetter | None]]:
        """Every record of ``<topic>.DLT`` up to its current end: (record, dead letter),
        or (record, None) for a removal marker."""
        dlt = self.dead_letter_topic(topic)
        reader = kafka.Consumer({
            **self._base, "group.id": f"msgpatterns-dlq-reader-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False, "enable.partition.eof": False,
        })
        try:
            metadata = reader.list_topics(dlt, timeout=self.delivery_timeout)
            info = metadata.topics.get(dlt)
            if info is None or info.error is not None:
                return
            ends: dict[int, int] = {}
            for partition in info.partitions:
                low, high = reader.get_watermark_offsets(
                    kafka.TopicPartition(dlt, partition), timeout=self.delivery_timeout)
                if high > low:
                    ends[partition] = high
            if not ends:
                return
            reader.assign([kafka.TopicPartition(dlt, p, kafka.OFFSET_BEGINNING) for p in ends])
            remaining = dict(ends)
            give_up = time.monotonic() + self.delivery_timeout
            while remaining and time.monotonic() < give_up:
                for record in reader.consume(num_messages=500, timeout=0.5):
                    if record.error() is not None:
                        continue
                    partition, offset = record.partition(), record.offset()
                    if offset + 1 >= remaining.get(partition, 0):
                        remaining.pop(partition, None)
                    headers = {k: codec.text(v) for k, v in record.headers() or []}
                    if DLQ_REMOVES in headers:
                        yield record, None
                        continue
                    yield record, codec.read_dead_letter(
                        record.value() or b"", headers,
                        fallback_id=f"{dlt}-{partition}-{offset}", fallback_topic=topic,
                        location={"dlt_partition": str(partition), "dlt_offset": str(offset)},
                    )
        finally:
            reader.close()

    def _live_dead_letters(self, topic: str) -> list[DeadLetter]:
        records: list[DeadLetter] = []
        removed: set[tuple[str, str]] = set()
        for record, letter in self._scan_dead_letters(topic):
            if letter is None:
                for where in json.loads(codec.text(dict(record.headers())[DLQ_REMOVES])):
                    removed.add((str(where[0]), str(where[1])))
            else:
                records.append(letter)
        return [r for r in records
                if (r.extra["dlt_partition"], r.extra["dlt_offset"]) not in removed]

    def _mark_removed(self, topic: str, records: Sequence[DeadLetter]) -> None:
        """Append a marker record that hides ``records`` from later listings."""
        where = [[int(r.extra["dlt_partition"]), int(r.extra["dlt_offset"])] for r in records]
        self._produce(self.dead_letter_topic(topic), b"", None,
                      {DLQ_REMOVES: json.dumps(where)})

    @staticmethod
    def _receipt(message: Message) -> _Receipt:
        receipt = message.receipt
        if not isinstance(receipt, _Receipt):
            raise ValueError(f"{message!r} was not delivered by a KafkaBroker")
        return receipt

    def __repr__(self) -> str:
        return f"KafkaBroker({self._base.get('bootstrap.servers')!r})"
