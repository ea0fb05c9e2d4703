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
* Identity: ``message.id`` is the publisher's id (the id header :meth:`publish`
  writes) or, for a record from another client, ``<topic>-<partition>-<offset>`` of
  its original position. A retry or dead letter carries that id in a header, so it is
  the same on every redelivery; it never comes from a counter that restarts.
* Lifecycle: :meth:`close` waits for operations in progress (a fetch in progress
  returns nothing it read after the close began), commits the settled prefixes
  synchronously, leaves the groups and closes the producer it created; a failed
  commit or an unflushed produce raises :class:`~msgpatterns.errors.BrokerError`.
  Afterwards every operation raises :class:`~msgpatterns.errors.BrokerClosed` at once
  and nothing reconnects. The broker is a context manager.
* Errors: the constructor fails within ``connect_timeout`` (5 s by default) with
  :class:`~msgpatterns.errors.BrokerUnavailable` when no broker answers; librdkafka's
  own log goes to the ``msgpatterns.brokers.kafka.librdkafka`` logger at DEBUG, never
  to stderr; a confluent-kafka exception never escapes bare (it is the ``__cause__``
  of a :class:`~msgpatterns.errors.BrokerError`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from msgpatterns._callables import renamed_arguments
from msgpatterns._escape import escape_control
from msgpatterns._extras import require
from msgpatterns.brokers import _codec as codec
from msgpatterns.brokers._adapter import BrokerAdapter
from msgpatterns.brokers._batch import failed, outgoing
from msgpatterns.brokers._kafka_records import (
    GroupState,
    KafkaReceipt,
    OffsetTracker,
    RecordView,
    bootstrap_servers,
    judge,
    malformed_letter,
)
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.delivery import receipt_of
from msgpatterns.errors import (
    BrokerClosed,
    BrokerError,
    BrokerUnavailable,
    ConfigurationError,
    seconds,
)
from msgpatterns.limits import DEFAULT_MAX_MESSAGE_BYTES, check_max_message_bytes
from msgpatterns.message import Message

kafka = require("confluent_kafka", "kafka")

if TYPE_CHECKING:
    from msgpatterns.brokers.admin.kafka import KafkaDeadLetters

__all__ = ["KafkaBroker", "OffsetTracker"]

#: Named in the error for a message this adapter did not deliver.
_OWNER = "a KafkaBroker"

log = logging.getLogger("msgpatterns.brokers.kafka")

#: Header of a dead-letter-topic marker record (moved to the codec; kept for imports).
DLQ_REMOVES = codec.REMOVES

#: librdkafka's own log (connection attempts, ...), forwarded at DEBUG.
rdkafka_log = logging.getLogger("msgpatterns.brokers.kafka.librdkafka")

#: Longest single wait inside a fetch: how soon a fetch notices close().
_FETCH_SLICE = 0.1

_UNAVAILABLE_CODES = frozenset(
    getattr(kafka.KafkaError, name) for name in (
        "_TRANSPORT", "_ALL_BROKERS_DOWN", "_TIMED_OUT", "_MSG_TIMED_OUT", "_RESOLVE",
        "_TIMED_OUT_QUEUE", "NETWORK_EXCEPTION", "REQUEST_TIMED_OUT",
        "BROKER_NOT_AVAILABLE", "LEADER_NOT_AVAILABLE",
    ) if hasattr(kafka.KafkaError, name)
)


class _LibrdkafkaLog:
    """The ``logger`` given to librdkafka: every line goes to :data:`rdkafka_log` at
    DEBUG (errors reach callers as exceptions, not as log spam on stderr)."""

    def log(self, level: int, msg: str, *args: Any) -> None:
        rdkafka_log.debug(msg, *args)


def _kafka_error(exc: BaseException, what: str) -> BrokerError:
    """The library's error for a confluent-kafka exception (keep it as the cause)."""
    error = exc.args[0] if exc.args else None
    if isinstance(error, kafka.KafkaError):
        kind = BrokerUnavailable if error.code() in _UNAVAILABLE_CODES else BrokerError
        return kind(f"Kafka {what} failed: {error.str()}")
    return BrokerError(f"Kafka {what} failed: {exc}")


class _Lifecycle:
    """Open until :meth:`close`; counts the operations in progress so that close can
    wait for them (librdkafka handles must not be closed under a running call)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self.closed = False

    @contextlib.contextmanager
    def operation(self, what: str) -> Iterator[None]:
        with self._cond:
            if self.closed:
                raise BrokerClosed(f"KafkaBroker.{what}: the broker is closed")
            self._active += 1
        try:
            yield
        except kafka.KafkaException as exc:
            raise _kafka_error(exc, what) from exc
        finally:
            with self._cond:
                self._active -= 1
                if not self._active:
                    self._cond.notify_all()

    def close(self, timeout: float) -> bool:
        """Refuse new operations and wait up to ``timeout`` for those in progress.
        False when already closed."""
        with self._cond:
            if self.closed:
                return False
            self.closed = True
            if not self._cond.wait_for(lambda: self._active == 0, timeout):
                log.warning("KafkaBroker.close: operations still running after %gs",
                            timeout)
            return True


_Receipt = KafkaReceipt
_Group = GroupState


def _view(record: Any) -> RecordView:
    """A confluent-kafka record as the adapters' client-neutral record."""
    stamp = record.timestamp()
    return RecordView(record.topic(), record.partition(), record.offset(), record.key(),
                      record.value(), tuple(record.headers() or ()),
                      stamp[1] if stamp[1] > 0 else None)


class KafkaBroker(BrokerAdapter):
    """The :class:`~msgpatterns.brokers.base.Broker` protocol on Kafka.

    Args:
        url: ``host:port[,host:port]``, a ``kafka://`` URL, or a librdkafka
            configuration dict (applied to consumers and the producer). The old
            keyword ``bootstrap_or_config=`` still works.
        consumer_config: extra settings for the group consumers (``group.id``,
            ``enable.auto.commit`` and the rebalance callbacks are set here).
        producer_config: extra settings for the producer.
        producer: a ``confluent_kafka.Producer`` to use instead of creating one.
        retry_suffix: suffix of the retry topic (``<topic>.retry``).
        dead_letter_suffix: suffix of the dead-letter topic (``<topic>.DLT``).
        delivery_timeout: seconds to wait for a produced record's confirmation.
        connect_timeout: seconds to wait for the cluster's metadata (the constructor
            checks that the cluster answers; an unreachable one raises
            :class:`~msgpatterns.errors.BrokerUnavailable` after this long).
        max_message_bytes: the largest record (value plus headers plus key) handed
            to the handler; a larger one is dead-lettered with the reason, its value
            kept (None: no bound; see :mod:`msgpatterns.limits`).
    """

    @renamed_arguments(bootstrap_or_config="url")
    def __init__(
        self,
        url: str | Mapping[str, Any],
        *,
        consumer_config: Mapping[str, Any] | None = None,
        producer_config: Mapping[str, Any] | None = None,
        producer: Any = None,
        retry_suffix: str = ".retry",
        dead_letter_suffix: str = ".DLT",
        delivery_timeout: float = 30.0,
        connect_timeout: float = 5.0,
        max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.max_message_bytes = check_max_message_bytes(max_message_bytes)
        if isinstance(url, str):
            self._base: dict[str, Any] = {"bootstrap.servers": bootstrap_servers(url)}
        elif isinstance(url, Mapping):
            self._base = dict(url)
        else:
            raise ConfigurationError(
                "KafkaBroker needs 'host:port', a kafka:// URL or a librdkafka config "
                f"dict, got {url!r}")
        self.delivery_timeout = seconds(delivery_timeout) or 0.0
        self.connect_timeout = seconds(connect_timeout) or 0.0
        self._base.setdefault("logger", _LibrdkafkaLog())
        self._base.setdefault("socket.connection.setup.timeout.ms",
                              max(1000, int(self.connect_timeout * 1000)))
        self._consumer_config = dict(consumer_config or {})
        self.retry_suffix = retry_suffix
        self.dead_letter_suffix = dead_letter_suffix
        self._life = _Lifecycle()
        self._lock = threading.Lock()
        self._groups: dict[str, _Group] = {}
        self._owns_producer = producer is None
        self._producer = producer if producer is not None else self._client(
            "Producer", {**self._base, "enable.idempotence": True, **(producer_config or {})})
        try:
            self._check_reachable()
        except BaseException:
            self._close_producer()
            raise

    def _client(self, kind: str, config: dict[str, Any]) -> Any:
        """A confluent-kafka client; a configuration librdkafka refuses is a
        :class:`~msgpatterns.errors.ConfigurationError`."""
        try:
            return getattr(kafka, kind)(config)
        except (kafka.KafkaException, ValueError, TypeError) as exc:
            raise ConfigurationError(f"KafkaBroker: invalid {kind.lower()} "
                                     f"configuration: {exc}") from exc

    def _check_reachable(self) -> None:
        """Raise BrokerUnavailable unless the cluster answers a metadata request
        within ``connect_timeout``."""
        try:
            self._producer.list_topics(timeout=self.connect_timeout)
        except kafka.KafkaException as exc:
            where = self._base.get("bootstrap.servers")
            raise BrokerUnavailable(
                f"Kafka at {where} did not answer within {self.connect_timeout:g}s "
                f"({_kafka_error(exc, 'metadata request')}); check the address and that "
                "the cluster is up") from exc

    # -- names ----------------------------------------------------------------------

    def retry_topic(self, topic: str) -> str:
        return topic + self.retry_suffix

    def dead_letter_topic(self, topic: str) -> str:
        return topic + self.dead_letter_suffix

    # -- Broker protocol ------------------------------------------------------------

    def _publish(self, topic: str, payload: bytes, key: str | None,
                 headers: Mapping[str, str]) -> str:
        """Produce to ``topic`` and wait for the broker's confirmation; the message id
        is kept in a header, stable across retries."""
        with self._life.operation("publish"):
            message_id = uuid.uuid4().hex
            self._produce(topic, payload, key,
                          codec.wire_headers(headers, message_id=message_id))
            return message_id

    @property
    def closed(self) -> bool:
        return self._life.closed

    def publish_many(self, topic: str, items: Iterable[Any]) -> list[str]:
        """Produce ``items`` (bodies, or :class:`~msgpatterns.brokers.Outgoing` with key
        and headers) to ``topic``, flush once and wait for every confirmation; returns
        the message ids in order, as :meth:`publish` would.

        Not atomic: each record is confirmed on its own. If any is not confirmed within
        ``delivery_timeout`` (or refused), :class:`~msgpatterns.brokers.PartialPublish`
        says which were (those are written; the others may or may not be). Records of
        one key keep their order (the producer is idempotent)."""
        with self._life.operation("publish_many"):
            batch = [(uuid.uuid4().hex, body_bytes(item.body), item)
                     for item in outgoing(items)]
            reports: dict[int, Any] = {}  # index -> delivery error (None: confirmed)

            def report(index: int) -> Any:
                def on_delivery(error: Any, record: Any) -> None:
                    reports[index] = error
                return on_delivery

            failure: BaseException | None = None
            sent = 0
            try:
                for index, (message_id, value, item) in enumerate(batch):
                    self._send(topic, value, item.key,
                               codec.wire_headers(item.headers, message_id=message_id),
                               report(index))
                    sent += 1
            except (kafka.KafkaException, BrokerError) as exc:
                failure = exc
            give_up = time.monotonic() + self.delivery_timeout
            while len(reports) < sent and time.monotonic() < give_up:
                self._producer.flush(min(0.5, max(0.0, give_up - time.monotonic())))
            ids = [message_id if index in reports and reports[index] is None else None
                   for index, (message_id, _, _) in enumerate(batch)]
            if failure is None and all(ids):
                return [i for i in ids if i is not None]
            errors = [e for e in reports.values() if e is not None]
            first = failure if failure is not None else (
                kafka.KafkaException(errors[0]) if errors else BrokerUnavailable(
                    f"no delivery report within {self.delivery_timeout:g}s"))
            raise failed(topic, ids, first) from first

    def subscribe(self, topic: str, group: str) -> None:
        """Join ``group`` on ``topic`` now (a fetch does it otherwise)."""
        with self._life.operation("subscribe"):
            self._group(group, [topic])

    def _fetch_messages(self, topics: list[str], group: str, max_messages: int,
                       timeout: float) -> list[Message]:
        """Up to ``max_messages`` records of ``topics`` and their due retries, waiting
        up to ``timeout`` seconds. Commits what became safe to commit first.

        A fetch in progress when :meth:`close` begins returns at once, and nothing it
        read after that is handed out or counted (it stays uncommitted, so the group
        reads it again)."""
        with self._life.operation("fetch"):
            state = self._group(group, topics)
            self._commit(state, asynchronous=True)
            self._producer.poll(0)  # serve the producer's callbacks and log lines
            give_up = time.monotonic() + timeout
            while True:
                now = self.now()
                self._resume_due(state, now)
                with self._lock:
                    wait = state.wait(now, max(0.0, min(give_up - time.monotonic(),
                                                        _FETCH_SLICE)))
                records = state.consumer.consume(num_messages=max_messages, timeout=wait)
                if self._life.closed:
                    return []  # close() began: hand out nothing read since
                out: list[Message] = []
                now = self.now()
                rewound: set[tuple[str, int]] = set()
                failure: BrokerError | None = None
                for record in records:
                    if (record.topic(), record.partition()) in rewound:
                        continue  # re-read after the seek back
                    try:
                        message = self._accept(state, group, record, now)
                    except BrokerError as exc:
                        # only this partition is read again; the batch's records of
                        # the other partitions are still handed out (the consumer's
                        # position has passed them: dropping them would lose them)
                        self._rewind(state, record, rewound)
                        failure = failure or exc
                        continue
                    if message is not None:
                        out.append(message)
                if failure is not None and not out:
                    raise failure
                if out or time.monotonic() >= give_up:
                    return out

    def ack(self, message: Message) -> None:
        """Mark the record settled; the next fetch (or :meth:`commit`, or
        :meth:`close`) commits the contiguous settled prefix."""
        with self._life.operation("ack"):
            self._settled(receipt_of(message, _Receipt, _OWNER))

    def nack(self, message: Message, delay: float = 0.0) -> None:
        """Produce the retry (original payload, current headers, ``attempt + 1``, due
        in ``delay`` seconds) to ``<topic>.retry``; once confirmed, the record is
        settled."""
        with self._life.operation("nack"):
            r = receipt_of(message, _Receipt, _OWNER)
            if self._stale(r):
                log.debug("nack of %s ignored: its partition was revoked",
                          escape_control(message.id))
                return
            wire = codec.redelivery_headers(message, group=r.group,
                                            due_at=self.now() + delay)
            self._produce(self.retry_topic(message.topic), body_bytes(message.raw_body),
                          message.key, wire)
            self._settled(r)

    def dead_letter(self, message: Message, record: DeadLetter) -> None:
        """Produce the record to ``<topic>.DLT``; once confirmed, the record is settled."""
        with self._life.operation("dead_letter"):
            r = receipt_of(message, _Receipt, _OWNER)
            if self._stale(r):
                log.debug("dead letter of %s ignored: its partition was revoked",
                          escape_control(message.id))
                return
            self._produce(self.dead_letter_topic(message.topic),
                          codec.dead_letter_body(record), message.key,
                          codec.dead_letter_headers(record))
            self._settled(r)

    def commit(self) -> dict[tuple[str, str, int], int]:
        """Commit every group's settled prefix now (synchronously); returns the
        committed position of every assigned partition that has one, by
        ``(group, topic, partition)``."""
        with self._life.operation("commit"):
            out: dict[tuple[str, str, int], int] = {}
            for group, state in list(self._groups.items()):
                self._commit(state, asynchronous=False)
                with self._lock:
                    for (topic, partition), tracker in state.trackers.items():
                        if tracker.committed is not None:
                            out[(group, topic, partition)] = tracker.committed
            return out

    def _close_consumer(self, consumer: Any) -> BaseException | None:
        """Close ``consumer`` (leave its group) within ``delivery_timeout``: librdkafka's
        close has no timeout of its own and can block on a broker that never answers,
        so it runs on a helper thread that is abandoned past the limit. (A stall inside
        confluent-kafka's rebalance callback, which holds the GIL, cannot be bounded
        from Python: seen once with a classic-protocol consumer closed mid-join on the
        mock cluster.)"""
        outcome: list[BaseException] = []

        def leave() -> None:
            try:
                consumer.close()
            except BaseException as exc:
                outcome.append(exc)

        closer = threading.Thread(target=leave, name="msgpatterns-kafka-close", daemon=True)
        closer.start()
        closer.join(self.delivery_timeout)
        if closer.is_alive():
            return BrokerUnavailable(
                f"a consumer did not leave its group within {self.delivery_timeout:g}s")
        return outcome[0] if outcome else None

    def close(self) -> None:
        """Wait for operations in progress, commit the settled prefixes
        (synchronously), leave the groups, and flush and close the producer this broker
        created (a ``producer=`` given by the caller is flushed, not closed).

        Everything is closed even when a step fails; the first failure is then raised
        as a :class:`~msgpatterns.errors.BrokerError`. Idempotent.
        """
        if not self._life.close(self.delivery_timeout + _FETCH_SLICE):
            return
        failures: list[BaseException] = []
        for state in list(self._groups.values()):
            try:
                self._commit(state, asynchronous=False, strict=True)
            except BaseException as exc:
                failures.append(exc)
            failure = self._close_consumer(state.consumer)
            if failure is not None:
                failures.append(failure)
        self._groups.clear()
        try:
            left = self._producer.flush(self.delivery_timeout)
            if left:
                failures.append(BrokerUnavailable(
                    f"{left} produced record(s) not confirmed within "
                    f"{self.delivery_timeout:g}s"))
        except BaseException as exc:
            failures.append(exc)
        self._close_producer()
        if failures:
            first = failures[0]
            if isinstance(first, BrokerError):
                raise first
            raise _kafka_error(first, "close") from first

    def _close_producer(self) -> None:
        if self._owns_producer:
            with contextlib.suppress(Exception):
                self._producer.close()

    # -- dead-letter admin ----------------------------------------------------------

    def dead_letter_admin(self) -> KafkaDeadLetters:
        """The admin of the ``<topic>.DLT`` topics, on this broker's producer."""
        from msgpatterns.brokers.admin.kafka import KafkaDeadLetters

        return KafkaDeadLetters(self)

    # -- internals --------------------------------------------------------------------

    def _group(self, group: str, topics: Sequence[str]) -> _Group:
        state = self._groups.get(group)
        wanted = tuple(topics)
        if state is not None and state.topics == wanted:
            return state
        if state is None:
            consumer = self._client("Consumer", {
                **self._base,
                "auto.offset.reset": "earliest",
                **self._consumer_config,
                "group.id": group,
                "enable.auto.commit": False,
                "on_commit": self._on_commit,
            })
            state = _Group(consumer, wanted)
            self._groups[group] = state
        self._subscribe(state, wanted)
        return state

    def _adopt(self, group: str, consumer: Any, topics: Sequence[str]) -> _Group:
        """Run ``group`` on a consumer the caller created and owns (a raw poll loop:
        :mod:`msgpatterns.raw.kafka`): the same subscription to ``topics`` and their
        retry topics, rebalance callbacks and offset trackers as a fetch's own.
        :meth:`close` closes it; :meth:`_release` hands it back instead."""
        if group in self._groups:
            raise ConfigurationError(f"{self!r} already consumes group {group!r}")
        state = _Group(consumer)
        self._groups[group] = state
        self._subscribe(state, tuple(topics))
        return state

    def _release(self, group: str) -> None:
        """Forget an adopted group without closing its consumer."""
        self._groups.pop(group, None)

    def _subscribe(self, state: _Group, wanted: tuple[str, ...]) -> None:
        """Subscribe ``state``'s consumer to ``wanted`` and their retry topics."""
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

    def _touch(self, topics: Sequence[str]) -> None:
        """Ask for the topics' metadata through the producer, which makes a cluster
        that auto-creates topics create them now, before the subscription looks."""
        for topic in topics:
            try:
                self._producer.list_topics(topic, timeout=self.connect_timeout)
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
            tracker = state.tracker(where)
        view = _view(record)
        verdict = judge(view, state.retry_topics, group, now,
                        limit=self.max_message_bytes)
        if verdict.action == "reject":
            assert verdict.problem is not None
            self._reject_malformed(group, view, verdict.topic, tracker, verdict.problem, now,
                                   too_large=verdict.too_large)
            return None
        if verdict.action == "wait":
            assert verdict.due_at is not None
            self._pause(state, view.read_topic, view.partition, offset, verdict.due_at)
            return None
        with self._lock:
            tracker.delivered(offset)
            if verdict.action == "skip":  # another group's retry: nothing to do here
                tracker.settled(offset)
                return None
        message = verdict.message
        assert message is not None
        message.receipt = _Receipt(group, view.read_topic, view.partition, offset,
                                   tracker.epoch)
        return message

    def _reject_malformed(self, group: str, record: RecordView, topic: str,
                          tracker: OffsetTracker, problem: str, now: float, *,
                          too_large: bool = False) -> None:
        """Dead-letter a record the adapter cannot hand out faithfully (raw value and
        header bytes kept, the reason in the record; ``too_large``: over
        ``max_message_bytes``); settled once confirmed."""
        letter, unreadable = malformed_letter(record, topic, group, problem, now,
                                              too_large=too_large)
        log.warning("%s: %s %s dead-lettered: %s", group, topic, record.position,
                    escape_control(problem))
        self._produce(self.dead_letter_topic(topic), record.value,
                      letter.message.key, codec.dead_letter_headers(letter),
                      extra=unreadable)
        with self._lock:
            tracker.delivered(record.offset)
            tracker.settled(record.offset)

    def _rewind(self, state: _Group, record: Any, rewound: set[tuple[str, int]]) -> None:
        """A record could not be settled at fetch time: read its partition again from
        it (later records of the partition in this batch are not handed out)."""
        rewound.add((record.topic(), record.partition()))
        with contextlib.suppress(kafka.KafkaException):
            state.consumer.seek(kafka.TopicPartition(record.topic(), record.partition(),
                                                     record.offset()))

    def _pause(self, state: _Group, topic: str, partition: int, offset: int,
               due: float) -> None:
        """Hold a retry partition at ``offset`` until ``due``."""
        state.consumer.seek(kafka.TopicPartition(topic, partition, offset))
        state.consumer.pause([kafka.TopicPartition(topic, partition)])
        with self._lock:
            state.pause((topic, partition), due)

    def _resume_due(self, state: _Group, now: float) -> None:
        with self._lock:
            due = state.due(now)
        if due:
            state.consumer.resume([kafka.TopicPartition(t, p) for t, p in due])

    def _on_assign(self, state: _Group, partitions: list[Any]) -> None:
        with self._lock:
            state.assigned((tp.topic, tp.partition) for tp in partitions)

    def _on_revoke(self, state: _Group, consumer: Any, partitions: list[Any]) -> None:
        """Commit the revoked partitions' settled prefix (unless lost) and forget them:
        their in-flight messages' settlements become no-ops."""
        with self._lock:
            positions = state.revoked((tp.topic, tp.partition) for tp in partitions)
        offsets = [kafka.TopicPartition(t, p, o) for (t, p), o in positions.items()]
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
                state.forget_commits((tp.topic, tp.partition) for tp in partitions)

    def _commit(self, state: _Group, *, asynchronous: bool,
                strict: bool = False) -> list[Any]:
        """Commit the settled prefixes that moved; a failure is logged and retried on
        the next fetch, or raised when ``strict``."""
        with self._lock:
            moved = state.moved()
        offsets = [kafka.TopicPartition(t, p, o) for (t, p), o in moved.items()]
        if offsets:
            try:
                state.consumer.commit(offsets=offsets, asynchronous=asynchronous)
            except kafka.KafkaException as exc:
                self._forget_commits([state], offsets)
                if strict:
                    raise _kafka_error(exc, "offset commit") from exc
                log.warning("offset commit failed (%s); retrying on the next fetch", exc)
                return []
        return offsets

    def _stale(self, r: _Receipt) -> bool:
        state = self._groups.get(r.group)
        with self._lock:
            return state is None or state.current(r) is None

    def _settled(self, r: _Receipt) -> None:
        state = self._groups.get(r.group)
        with self._lock:
            tracker = None if state is None else state.current(r)
            if tracker is not None:
                tracker.settled(r.offset)

    def _produce(self, topic: str, value: bytes | None, key: str | None,
                 headers: Mapping[str, str],
                 extra: Sequence[tuple[str, Any]] = ()) -> tuple[int, int]:
        """Produce one record (``extra``: raw header pairs appended as they are) and
        wait for its delivery report; (partition, offset)."""
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def on_delivery(error: Any, produced: Any) -> None:
            outcome["error"], outcome["record"] = error, produced
            done.set()

        self._send(topic, value, key, headers, on_delivery, extra)
        give_up = time.monotonic() + self.delivery_timeout
        while not done.is_set():
            if time.monotonic() > give_up:
                raise BrokerUnavailable(f"Kafka produce to {topic}: no delivery report "
                                        f"within {self.delivery_timeout:g}s")
            self._producer.poll(0.05)
        if outcome["error"] is not None:
            raise _kafka_error(kafka.KafkaException(outcome["error"]), f"produce to {topic}")
        produced = outcome["record"]
        return produced.partition(), produced.offset()

    def _send(self, topic: str, value: bytes | None, key: str | None,
              headers: Mapping[str, str], on_delivery: Any,
              extra: Sequence[tuple[str, Any]] = ()) -> None:
        """Hand one record to the producer; while its local queue is full, serve
        delivery reports and try again (until ``delivery_timeout``)."""
        give_up = time.monotonic() + self.delivery_timeout
        while True:
            try:
                self._producer.produce(
                    topic, value=value, key=None if key is None else key.encode("utf-8"),
                    headers=[*headers.items(), *extra], on_delivery=on_delivery,
                )
                return
            except BufferError as exc:
                if time.monotonic() > give_up:
                    raise BrokerUnavailable(f"Kafka produce to {topic}: the producer "
                                            f"queue stayed full for "
                                            f"{self.delivery_timeout:g}s") from exc
                self._producer.poll(0.05)


    def __repr__(self) -> str:
        return f"KafkaBroker({self._base.get('bootstrap.servers')!r})"
