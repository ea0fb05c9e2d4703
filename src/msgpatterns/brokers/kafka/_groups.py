"""The consumer side of :class:`~msgpatterns.brokers.kafka.broker.KafkaBroker`: one
consumer per group (or one a raw loop adopted), subscribed to the topics and their retry
topics; each record judged by the wire core (hand out, skip another group's retry, pause
a retry not yet due, dead-letter a malformed one); rebalances; and the commits of the
contiguous settled prefix of each partition. A part of the adapter: its state is the
adapter's."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from msgpatterns._escape import escape_control
from msgpatterns.brokers import codec
from msgpatterns.brokers.kafka._link import Lifecycle, kafka, kafka_error
from msgpatterns.brokers.kafka._link import view as view_of
from msgpatterns.brokers.kafka._records import (
    GroupState,
    KafkaReceipt,
    OffsetTracker,
    RecordView,
    judge,
    malformed_letter,
)
from msgpatterns.errors import BrokerError, BrokerUnavailable, ConfigurationError
from msgpatterns.headers import WireBounds
from msgpatterns.message import Message

__all__ = ["GroupConsumers"]

log = logging.getLogger("msgpatterns.brokers.kafka")


class GroupConsumers:
    """Group consumers, rebalances and commits (see the module docstring)."""

    connect_timeout: float
    delivery_timeout: float
    max_message_bytes: int | None
    _base: dict[str, Any]
    _consumer_config: dict[str, Any]
    _life: Lifecycle
    _lock: threading.Lock
    _groups: dict[str, GroupState]
    _producer: Any

    if TYPE_CHECKING:  # the adapter's own, elsewhere
        def wire_bounds(self, group: str) -> WireBounds: ...
        def now(self) -> float: ...
        def retry_topic(self, topic: str) -> str: ...
        def dead_letter_topic(self, topic: str) -> str: ...
        def _client(self, kind: str, config: dict[str, Any]) -> Any: ...
        def _produce(self, topic: str, value: bytes | None, key: str | None,
                     headers: Mapping[str, str],
                     extra: Sequence[tuple[str, Any]] = ()) -> tuple[int, int]: ...

    # -- steps a raw poll loop builds on (msgpatterns.brokers.kafka.raw) ------------------

    def adopt(self, group: str, consumer: Any, topics: Sequence[str]) -> GroupState:
        """Run ``group`` on a ``confluent_kafka.Consumer`` the caller created and owns:
        the same subscription to ``topics`` and their retry topics, rebalance callbacks
        and offset trackers as a fetch's own consumer. :meth:`close` closes it;
        :meth:`release` hands it back instead. Returns the group's state, which the
        other steps take."""
        return self._adopt(group, consumer, topics)

    def release(self, group: str) -> None:
        """Forget an adopted group without closing its consumer."""
        self._release(group)

    def message_of(self, state: GroupState, group: str, record: Any) -> Message | None:
        """The Message of a record ``state``'s consumer polled, or None when it is not
        one to handle now: an error/EOF event, another group's retry, a retry not yet
        due (its partition is paused and rewound to it), or a malformed record
        (dead-lettered with the reason). If dead-lettering a malformed record fails, its
        partition is rewound to it and the :class:`~msgpatterns.errors.BrokerError`
        raised."""
        with self._life.operation("message"):
            try:
                return self._accept(state, group, record, self.now())
            except BrokerError:
                self._rewind(state, record, set())
                raise

    def maintain(self, state: GroupState) -> float | None:
        """Resume ``state``'s retry partitions whose record is now due and commit the
        settled prefixes that moved (asynchronously); serve the producer. Returns
        seconds until the next paused retry is due (None: none paused)."""
        with self._life.operation("maintain"):
            now = self.now()
            self._resume_due(state, now)
            self._commit(state, asynchronous=True)
            self._producer.poll(0)
            with self._lock:
                due = min(state.paused.values(), default=None)
            return None if due is None else max(0.0, due - now)

    def commit_group(self, state: GroupState) -> dict[tuple[str, int], int]:
        """Commit ``state``'s settled prefixes now (synchronously), failing loudly
        (:class:`~msgpatterns.errors.BrokerError`); returns the committed position of
        each partition that has one."""
        with self._life.operation("commit"):
            with self._lock:
                for tracker in state.trackers.values():
                    tracker.committed = None  # an async commit may have failed unseen
            self._commit(state, asynchronous=False, strict=True)
            with self._lock:
                return {where: t.committed for where, t in state.trackers.items()
                        if t.committed is not None}

    # -- internals --------------------------------------------------------------------

    def _group(self, group: str, topics: Sequence[str]) -> GroupState:
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
                "on_commit": functools.partial(self._on_commit, group),
            })
            state = GroupState(consumer, wanted)
            self._groups[group] = state
        self._subscribe(state, wanted)
        return state


    def _adopt(self, group: str, consumer: Any, topics: Sequence[str]) -> GroupState:
        """Run ``group`` on a consumer the caller created and owns (a raw poll loop:
        :mod:`msgpatterns.brokers.kafka.raw`): the same subscription to ``topics`` and their
        retry topics, rebalance callbacks and offset trackers as a fetch's own.
        :meth:`close` closes it; :meth:`_release` hands it back instead."""
        if group in self._groups:
            raise ConfigurationError(f"{self!r} already consumes group {group!r}")
        state = GroupState(consumer)
        self._groups[group] = state
        self._subscribe(state, tuple(topics))
        return state


    def _release(self, group: str) -> None:
        """Forget an adopted group without closing its consumer."""
        self._groups.pop(group, None)


    def _subscribe(self, state: GroupState, wanted: tuple[str, ...]) -> None:
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


    def _accept(self, state: GroupState, group: str, record: Any, now: float) -> Message | None:
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
        view = view_of(record)
        verdict = judge(view, state.retry_topics, group, now,
                        limit=self.max_message_bytes, bounds=self.wire_bounds(group))
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
        message.receipt = KafkaReceipt(group, view.read_topic, view.partition, offset,
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


    def _rewind(self, state: GroupState, record: Any, rewound: set[tuple[str, int]]) -> None:
        """A record could not be settled at fetch time: read its partition again from
        it (later records of the partition in this batch are not handed out)."""
        rewound.add((record.topic(), record.partition()))
        with contextlib.suppress(kafka.KafkaException):
            state.consumer.seek(kafka.TopicPartition(record.topic(), record.partition(),
                                                     record.offset()))


    def _pause(self, state: GroupState, topic: str, partition: int, offset: int,
               due: float) -> None:
        """Hold a retry partition at ``offset`` until ``due``."""
        state.consumer.seek(kafka.TopicPartition(topic, partition, offset))
        state.consumer.pause([kafka.TopicPartition(topic, partition)])
        with self._lock:
            state.pause((topic, partition), due)


    def _resume_due(self, state: GroupState, now: float) -> None:
        with self._lock:
            due = state.due(now)
        if due:
            state.consumer.resume([kafka.TopicPartition(t, p) for t, p in due])


    def _on_assign(self, state: GroupState, partitions: list[Any]) -> None:
        with self._lock:
            state.assigned((tp.topic, tp.partition) for tp in partitions)


    def _on_revoke(self, state: GroupState, consumer: Any, partitions: list[Any]) -> None:
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


    def _on_commit(self, group: str, error: Any, partitions: list[Any]) -> None:
        """A commit's outcome (served by ``consume``/``close`` on the fetching thread).
        Committed again on the next fetch: the partitions whose commit failed - all of
        them on a request error, else each one whose own ``error`` is set - and those a
        late, retried commit moved back (:meth:`GroupState.commits_confirmed`)."""
        state = self._groups.get(group)
        if error is not None:
            if error.code() == kafka.KafkaError._NO_OFFSET:
                return
            failed = list(partitions)
        else:
            failed = [tp for tp in partitions if tp.error is not None]
            if state is not None:
                with self._lock:
                    stale = state.commits_confirmed(
                        ((tp.topic, tp.partition), tp.offset)
                        for tp in partitions if tp.error is None)
                if stale:
                    log.info("a late offset commit moved %s back; committing again",
                             stale)
            if not failed:
                return
            error = failed[0].error
        log.warning("offset commit failed (%s); retrying on the next fetch", error)
        self._forget_commits([state] if state is not None else [], failed)


    def _forget_commits(self, states: Sequence[GroupState], partitions: Sequence[Any]) -> None:
        """A commit of ``partitions`` failed: the next fetch commits them again."""
        with self._lock:
            for state in states:
                state.forget_commits((tp.topic, tp.partition) for tp in partitions)


    def _commit(self, state: GroupState, *, asynchronous: bool,
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
                    raise kafka_error(exc, "offset commit") from exc
                log.warning("offset commit failed (%s); retrying on the next fetch", exc)
                return []
        return offsets


    def _stale(self, r: KafkaReceipt) -> bool:
        state = self._groups.get(r.group)
        with self._lock:
            return state is None or state.current(r) is None


    def _settled(self, r: KafkaReceipt) -> None:
        state = self._groups.get(r.group)
        with self._lock:
            tracker = None if state is None else state.current(r)
            if tracker is not None:
                tracker.settled(r.offset)


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
