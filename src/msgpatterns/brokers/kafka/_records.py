"""What the Kafka adapters share, whatever client reads the records: the offset
tracker (commit only the contiguous settled prefix of a partition), the check that a
record can be handed out faithfully, and the record -> :class:`Message` /
:class:`DeadLetter` mapping of the wire format (:mod:`msgpatterns.brokers.codec`).

It imports no Kafka client: the sync adapter (confluent-kafka) and the asyncio adapter
(aiokafka) both call it, so a record means the same to both.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from msgpatterns import headers as h
from msgpatterns._redact import redact_url
from msgpatterns.brokers import codec
from msgpatterns.deadletter import DeadLetter
from msgpatterns.errors import ConfigurationError, MalformedMessage
from msgpatterns.limits import MessageTooLarge, oversize_reason
from msgpatterns.message import Message

__all__ = ["GroupState", "KafkaReceipt", "OffsetTracker", "RecordView", "Verdict",
           "bootstrap_servers", "judge", "malformed", "malformed_letter", "record_message", "utf8"]

#: A partition: (topic, partition).
Where = tuple[str, int]


class OffsetTracker:
    """One partition's delivered offsets and which of them are settled.

    :meth:`position` is the offset to commit: the first delivered offset not yet
    settled, or one past the last delivered when all are. It never passes an
    unsettled offset, whatever order settlements arrive in.
    """

    __slots__ = ("_done", "_last", "_open", "_pending", "committed", "confirmed", "epoch")

    def __init__(self, epoch: int = 0) -> None:
        self.epoch = epoch
        self._pending: deque[int] = deque()  # delivered, in order, up to the position
        self._open: set[int] = set()  # the same offsets, for lookups
        self._done: set[int] = set()  # the settled ones among them
        self._last: int | None = None
        self.committed: int | None = None  # the last offset sent to be committed
        self.confirmed: int | None = None  # the highest one the cluster confirmed

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


_EPOCHS = itertools.count(1)  # tracker generations: a receipt names the one it came from



def bootstrap_servers(url: str) -> str:
    """The ``host:port[,host:port]`` list of ``url`` (a ``kafka://`` URL or the list
    itself), as both Kafka adapters and the CLI put it into their client's config.

    Credentials in the URL are refused with a ConfigurationError that never shows the
    password: the bootstrap list is logged and shown by the Kafka clients themselves
    (librdkafka's own log lines), and they have settings of their own for SASL."""
    servers = url.split("://", 1)[1] if "://" in url else url
    if "@" in servers.split("/", 1)[0]:
        raise ConfigurationError(
            f"credentials in a Kafka URL are not supported ({redact_url(url)}): give "
            "host:port and the SASL settings in the client configuration "
            "(librdkafka's security.protocol, sasl.mechanism, sasl.username, "
            "sasl.password)")
    return servers


@dataclass(frozen=True, slots=True)
class KafkaReceipt:
    """Where a delivered record came from: its group, the topic it was read from (the
    topic or its retry topic), partition, offset, and the epoch of the partition's
    tracker (a settlement from before a revocation finds another epoch: ignored)."""

    group: str
    topic: str
    partition: int
    offset: int
    epoch: int


@dataclass
class GroupState:
    """One consumer group's client and partitions: an offset tracker per partition
    (a fresh epoch on every assignment) and the retry partitions paused until a due
    time. Not thread-safe: the sync adapter holds its lock around every call."""

    consumer: Any
    topics: tuple[str, ...] = ()
    retry_topics: dict[str, str] = field(default_factory=dict)  # retry topic -> topic
    trackers: dict[Where, OffsetTracker] = field(default_factory=dict)
    paused: dict[Where, float] = field(default_factory=dict)  # -> due time

    def tracker(self, where: Where) -> OffsetTracker:
        """The tracker of ``where`` (a new one for a partition not seen yet)."""
        found = self.trackers.get(where)
        if found is None:
            found = self.trackers[where] = OffsetTracker(next(_EPOCHS))
        return found

    def assigned(self, partitions: Iterable[Where]) -> None:
        for where in partitions:
            self.trackers[where] = OffsetTracker(next(_EPOCHS))
            self.paused.pop(where, None)

    def revoked(self, partitions: Iterable[Where]) -> dict[Where, int]:
        """Forget ``partitions`` (their receipts go stale); the settled prefixes to
        commit for them."""
        out: dict[Where, int] = {}
        for where in partitions:
            tracker = self.trackers.pop(where, None)
            self.paused.pop(where, None)
            position = None if tracker is None else tracker.position()
            if tracker is not None and position is not None \
                    and position != tracker.committed:
                out[where] = position
        return out

    def moved(self) -> dict[Where, int]:
        """The settled prefixes that moved since the last commit, marked committed
        (:meth:`forget_commits` undoes that when the commit fails)."""
        out: dict[Where, int] = {}
        for where, tracker in self.trackers.items():
            position = tracker.position()
            if position is not None and position != tracker.committed:
                out[where] = tracker.committed = position
        return out

    def commits_confirmed(self, confirmed: Iterable[tuple[Where, int]]) -> list[Where]:
        """Successful commit outcomes, in the order they arrived; the partitions to
        commit again. Outcomes arrive in the order the cluster applied the commits, and
        a commit retried by the client after its coordinator came back can land after
        newer ones: an outcome below one already confirmed moved the committed offset
        back, so that partition's settled prefix is committed again (never left behind,
        which would redeliver settled records after a restart)."""
        stale: list[Where] = []
        for where, offset in confirmed:
            tracker = self.trackers.get(where)
            if tracker is None:
                continue
            if tracker.confirmed is not None and offset < tracker.confirmed:
                tracker.committed = None
                stale.append(where)
            else:
                tracker.confirmed = offset
        return stale

    def forget_commits(self, partitions: Iterable[Where]) -> None:
        for where in partitions:
            found = self.trackers.get(where)
            if found is not None:
                found.committed = None

    def current(self, r: KafkaReceipt) -> OffsetTracker | None:
        """The tracker ``r`` was handed out under, None when its partition was revoked
        since."""
        found = self.trackers.get((r.topic, r.partition))
        return found if found is not None and found.epoch == r.epoch else None

    def pause(self, where: Where, due: float) -> None:
        self.paused[where] = due

    def due(self, now: float) -> list[Where]:
        """The paused partitions due by ``now``, unpaused here (resume them)."""
        ready = [where for where, when in self.paused.items() if when <= now]
        for where in ready:
            del self.paused[where]
        return ready

    def wait(self, now: float, longest: float) -> float:
        """How long a poll may wait: ``longest``, or less when a retry is due sooner."""
        if self.paused:
            return min(longest, max(0.0, min(self.paused.values()) - now))
        return longest


@dataclass(frozen=True, slots=True)
class RecordView:
    """A consumed record, client-neutral: where it was read (``read_topic``: the topic
    or its retry topic), its raw key, value and header pairs, and its timestamp in
    milliseconds (None when the broker set none)."""

    read_topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, Any], ...]
    timestamp_ms: int | None

    @property
    def position(self) -> str:
        return f"{self.read_topic}-{self.partition}-{self.offset}"


def utf8(value: Any) -> bool:
    """Whether a header value is text (bytes that decode as UTF-8, or not bytes)."""
    if isinstance(value, bytes | bytearray):
        try:
            bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return False
    return True


def malformed(value: bytes | None, headers: Iterable[tuple[str, Any]]) -> str | None:
    """Why a record cannot be handed out as a Message faithfully, or None: a null
    value (a Message body is bytes), a header value that is not UTF-8 (headers are
    text), an attempt header that is not a positive integer (the attempt is unknown)."""
    if value is None:
        return "the record has a null value (a tombstone); a message needs a body"
    for name, raw in headers:
        if not utf8(raw):
            return f"header {name!r} is not UTF-8: {bytes(raw)[:64]!r}"
        if name == h.ATTEMPT:
            text = codec.text(raw)
            if not text.strip().isdigit() or int(text) < 1:
                return f"header {h.ATTEMPT!r} is not a positive integer: {text[:64]!r}"
    return None


def record_message(record: RecordView, topic: str, t: codec.Transport,
                   bounds: h.WireBounds = h.WIRE_LIMITS) -> Message:
    """The message for a well-formed ``record`` of ``topic`` (its transport headers
    ``t`` already split off): the publisher's id, or the record's position; its
    attempt header as far as the consumer's ``bounds`` trust it."""
    stamp = record.timestamp_ms
    return Message(
        record.value or b"",
        id=t.id or record.position,
        key=codec.text(record.key) if record.key is not None else t.key,
        topic=topic,
        headers=t.headers,
        timestamp=t.timestamp or (stamp / 1000 if stamp is not None and stamp > 0 else None),
        attempt=codec.attempt_of(t.headers, 0, bounds),
        partition=record.partition,
        offset=record.offset,
    )


def malformed_letter(record: RecordView, topic: str, group: str, problem: str,
                     now: float, *, too_large: bool = False,
                     ) -> tuple[DeadLetter, list[tuple[str, Any]]]:
    """The dead letter of a record that cannot be handed out (``problem`` says why;
    ``too_large``: it is over ``max_message_bytes``), and its header pairs that are not
    text (to append to the dead letter raw)."""
    readable = {k: codec.text(v) for k, v in record.headers if utf8(v)}
    transport = codec.split_transport(readable)
    message = Message(
        record.value or b"",
        id=transport.id or record.position,
        key=codec.text(record.key) if record.key is not None else transport.key,
        topic=topic,
        headers={k: v for k, v in transport.headers.items() if k != h.ATTEMPT},
        timestamp=transport.timestamp,
        partition=record.partition,
        offset=record.offset,
    )
    error = MessageTooLarge if too_large else MalformedMessage
    letter = DeadLetter(
        message=message, error_type=f"{error.__module__}.{error.__qualname__}",
        error_message=problem, traceback="", attempts=1, first_failed_at=now,
        last_failed_at=now,
        reason=f"{'oversized' if too_large else 'malformed'} record: {problem}", group=group,
    )
    return letter, [(k, v) for k, v in record.headers if not utf8(v)]


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a consumer of ``group`` does with a record it read:

    * ``"deliver"``: hand out :attr:`message` (of :attr:`topic`);
    * ``"reject"``: dead-letter it as malformed (:attr:`problem` says why;
      :attr:`too_large`: it is over ``max_message_bytes``);
    * ``"skip"``: another group's retry - settle it, nothing to do;
    * ``"wait"``: a retry not due before :attr:`due_at` - hold its partition there.
    """

    action: Literal["deliver", "reject", "skip", "wait"]
    topic: str
    message: Message | None = None
    problem: str | None = None
    due_at: float | None = None
    too_large: bool = False


def judge(record: RecordView, retry_topics: Mapping[str, str], group: str,
          now: float, *, limit: int | None,
          bounds: h.WireBounds = h.WIRE_LIMITS) -> Verdict:
    """The :class:`Verdict` on ``record`` for ``group`` at ``now``; ``retry_topics``
    maps each retry topic read to its topic; ``limit``: the adapter's
    ``max_message_bytes`` (a larger record, value plus headers plus key, is rejected);
    ``bounds``: the group's policy bounds (an attempt header beyond them is ignored, a
    due time beyond them is due now: :mod:`msgpatterns.headers`)."""
    topic = retry_topics.get(record.read_topic, record.read_topic)
    oversize = oversize_reason(record.value, record.headers, record.key, limit=limit)
    if oversize is not None:
        return Verdict("reject", topic, problem=oversize, too_large=True)
    problem = malformed(record.value, record.headers) or h.header_problem(
        {k: codec.text(v) for k, v in record.headers if k.startswith(h.PREFIX)}, now=now)
    if problem is not None:
        return Verdict("reject", topic, problem=problem)
    t = codec.split_transport(record.headers)
    if record.read_topic in retry_topics:
        if t.group is not None and t.group != group:
            return Verdict("skip", topic)
        due_at = h.honoured_due_at(t.due_at, now, bounds)
        if due_at is not None:
            return Verdict("wait", topic, due_at=due_at)
    return Verdict("deliver", topic, message=record_message(record, topic, t, bounds))
