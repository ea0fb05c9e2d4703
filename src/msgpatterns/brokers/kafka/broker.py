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
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from msgpatterns._callables import renamed_arguments
from msgpatterns._escape import escape_control
from msgpatterns.brokers import codec
from msgpatterns.brokers._adapter import BrokerAdapter, admin_for
from msgpatterns.brokers._batch import failed, outgoing
from msgpatterns.brokers.admin.base import DeadLetterAdmin
from msgpatterns.brokers.kafka._groups import GroupConsumers
from msgpatterns.brokers.kafka._link import LibrdkafkaLog, Lifecycle, kafka, kafka_error
from msgpatterns.brokers.kafka._produce import Producing
from msgpatterns.brokers.kafka._records import (
    GroupState,
    KafkaReceipt,
    OffsetTracker,
    bootstrap_servers,
)
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.delivery import receipt_of
from msgpatterns.errors import (
    BrokerError,
    BrokerUnavailable,
    ConfigurationError,
    seconds,
)
from msgpatterns.limits import DEFAULT_MAX_MESSAGE_BYTES, check_max_message_bytes
from msgpatterns.message import Message

__all__ = ["KafkaBroker", "OffsetTracker"]

#: Named in the error for a message this adapter did not deliver.
_OWNER = "a KafkaBroker"

log = logging.getLogger("msgpatterns.brokers.kafka")

#: Header of a dead-letter-topic marker record (moved to the codec; kept for imports).
DLQ_REMOVES = codec.REMOVES

#: Longest single wait inside a fetch: how soon a fetch notices close().
_FETCH_SLICE = 0.1


class KafkaBroker(GroupConsumers, Producing, BrokerAdapter):
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
        self._base.setdefault("logger", LibrdkafkaLog())
        self._base.setdefault("socket.connection.setup.timeout.ms",
                              max(1000, int(self.connect_timeout * 1000)))
        self._consumer_config = dict(consumer_config or {})
        self.retry_suffix = retry_suffix
        self.dead_letter_suffix = dead_letter_suffix
        self._life = Lifecycle()
        self._lock = threading.Lock()
        self._groups: dict[str, GroupState] = {}
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
                f"({kafka_error(exc, 'metadata request')}); check the address and that "
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
        """Make sure ``group`` reads every record of ``topic`` published from now on.

        With the default ``auto.offset.reset=earliest``, a group without a committed
        offset reads a partition from its start, so this only creates ``topic`` and
        its retry topic (where the cluster auto-creates topics) and joins nothing: a
        broker object that publishes and subscribes but never fetches (an
        :class:`~msgpatterns.ordering.OrderedTopic` publisher declares every partition
        for its groups) never becomes a group member holding partitions nobody reads,
        and this object's own subscription of ``group`` is left as it is. With another
        reset policy it joins ``group`` on ``topic`` now, as a fetch would, to fix the
        group's start."""
        with self._life.operation("subscribe"):
            reset = str(self._consumer_config.get("auto.offset.reset", "earliest"))
            if reset.lower() in ("earliest", "smallest", "beginning"):
                self._touch([topic, self.retry_topic(topic)])
                return
            self._group(group, [topic])

    def idle(self, group: str, timeout: float) -> bool:
        """This process reads none of ``group``'s topics for now (an
        :class:`~msgpatterns.ordering.OrderedTopic` member that handed back all its
        partitions): leave ``group``'s subscription, and serve its consumer for up to
        ``timeout`` seconds instead of fetching.

        A member that simply stopped polling would hold up every rebalance of the group
        (a route change adds partition topics) until ``max.poll.interval.ms``, and with
        the eager protocol the other members' partitions stay revoked meanwhile. Leaving
        runs the revoke, which commits the settled prefix of what it held. The next
        :meth:`fetch` of ``group`` joins again. Returns False when this object has no
        consumer for ``group`` (nothing to serve: the caller waits itself)."""
        with self._life.operation("fetch"):
            state = self._groups.get(group)
            if state is None:
                return False
            self._commit(state, asynchronous=True)
            if state.topics:
                state.topics = ()
                state.retry_topics = {}
                state.consumer.unsubscribe()
            # serves the revoke (and its commit) and the commit callbacks; no partition
            # is assigned any more, so no record comes back to hand out
            state.consumer.poll(timeout)
            self._producer.poll(0)
            return True

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
            self._settled(receipt_of(message, KafkaReceipt, _OWNER))

    def nack(self, message: Message, delay: float = 0.0) -> None:
        """Produce the retry (original payload, current headers, ``attempt + 1``, due
        in ``delay`` seconds) to ``<topic>.retry``; once confirmed, the record is
        settled."""
        with self._life.operation("nack"):
            r = receipt_of(message, KafkaReceipt, _OWNER)
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
            r = receipt_of(message, KafkaReceipt, _OWNER)
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
            raise kafka_error(first, "close") from first

    def _close_producer(self) -> None:
        if self._owns_producer:
            with contextlib.suppress(Exception):
                self._producer.close()

    # -- dead-letter admin ----------------------------------------------------------

    def dead_letter_admin(self) -> DeadLetterAdmin:
        """The admin of the ``<topic>.DLT`` topics
        (:class:`~msgpatterns.brokers.kafka.admin.KafkaDeadLetters`), on this broker's
        producer."""
        return admin_for("msgpatterns.brokers.kafka.admin:KafkaDeadLetters", self)

    # -- steps the dead-letter admin builds on ----------------------------------------

    @contextlib.contextmanager
    def operation(self, what: str) -> Iterator[None]:
        """A step that uses this broker's clients: refused at once after :meth:`close`
        (:class:`~msgpatterns.errors.BrokerClosed`), waited for by :meth:`close`, and
        confluent-kafka's exceptions come out as the library's own."""
        with self._life.operation(what):
            yield

    def topic_names(self) -> set[str]:
        """The names of every topic of the cluster (asking for one topic could
        auto-create it), within ``connect_timeout``."""
        return set(self._producer.list_topics(timeout=self.connect_timeout).topics)

    def scan_consumer(self, group: str) -> Any:
        """A new ``confluent_kafka.Consumer`` on this broker's configuration, of
        ``group``, committing nothing and not stopping at a partition's end: the
        caller assigns, reads and closes it."""
        return self._client("Consumer", {
            **self._base, "group.id": group,
            "enable.auto.commit": False, "enable.partition.eof": False,
        })

    def __repr__(self) -> str:
        return f"KafkaBroker({self._base.get('bootstrap.servers')!r})"
