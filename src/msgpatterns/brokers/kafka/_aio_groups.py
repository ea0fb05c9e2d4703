"""The consumer side of :class:`~msgpatterns.brokers.kafka.aio.AIOKafkaBroker` (one
aiokafka consumer per group, subscribed to the topics and their retry topics with a
rebalance listener that keeps the offset trackers; each record judged by the wire core;
commits of the contiguous settled prefix), and what it shares with the adapter:
aiokafka's errors as the library's, a record as the wire core's
:class:`~._records.RecordView`. A part of the adapter: its state is the adapter's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from msgpatterns._escape import escape_control
from msgpatterns._extras import require
from msgpatterns.brokers import codec
from msgpatterns.brokers.kafka._records import (
    GroupState,
    KafkaReceipt,
    OffsetTracker,
    RecordView,
    judge,
    malformed_letter,
)
from msgpatterns.errors import BrokerError, BrokerUnavailable
from msgpatterns.headers import WireBounds
from msgpatterns.message import Message

aiokafka = require("aiokafka", "kafka")
errors = require("aiokafka.errors", "kafka")

__all__ = ["AsyncGroupConsumers", "aiokafka", "aiokafka_error", "errors", "view_of",
           "wire_headers"]

log = logging.getLogger("msgpatterns.aio.kafka")

UNAVAILABLE = tuple(
    getattr(errors, name) for name in (
        "KafkaConnectionError", "KafkaTimeoutError", "NodeNotReadyError",
        "RequestTimedOutError", "LeaderNotAvailableError", "NotLeaderForPartitionError",
        "NotEnoughReplicasError", "CoordinatorNotAvailableError",
    ) if hasattr(errors, name)
)


def aiokafka_error(exc: BaseException, what: str) -> BrokerError:
    """The library's error for an aiokafka (or timeout) exception."""
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return BrokerUnavailable(f"Kafka {what}: no answer in time")
    kind = BrokerUnavailable if isinstance(exc, UNAVAILABLE) else BrokerError
    return kind(f"Kafka {what} failed: {exc!r}")


def view_of(record: Any) -> RecordView:
    """An aiokafka ConsumerRecord as the adapters' client-neutral record."""
    stamp = record.timestamp
    return RecordView(record.topic, record.partition, record.offset, record.key,
                      record.value, tuple(record.headers or ()),
                      stamp if stamp is not None and stamp > 0 else None)


def wire_headers(headers: Mapping[str, str]) -> list[tuple[str, bytes]]:
    return [(k, v.encode("utf-8")) for k, v in headers.items()]


_Listener: Any = aiokafka.ConsumerRebalanceListener


class _Rebalance(_Listener):  # type: ignore[misc]
    """aiokafka's rebalance listener for one group: it keeps the offset trackers."""

    def __init__(self, broker: AsyncGroupConsumers, state: GroupState) -> None:
        self._broker = broker
        self._state = state

    async def on_partitions_revoked(self, revoked: Iterable[Any]) -> None:
        await self._broker._on_revoke(self._state, list(revoked))

    async def on_partitions_assigned(self, assigned: Iterable[Any]) -> None:
        self._broker._on_assign(self._state, list(assigned))




class AsyncGroupConsumers:
    """Group consumers, rebalances and commits (see the module docstring)."""

    bootstrap_servers: str
    connect_timeout: float
    max_message_bytes: int | None
    _consumer_config: dict[str, Any]
    _groups: dict[str, GroupState]
    _commits: dict[str, asyncio.Task[None]]

    if TYPE_CHECKING:  # the adapter's own, elsewhere
        def wire_bounds(self, group: str) -> WireBounds: ...
        def retry_topic(self, topic: str) -> str: ...
        def dead_letter_topic(self, topic: str) -> str: ...
        async def _started(self, client: Any, what: str) -> Any: ...
        async def _ready_producer(self) -> Any: ...
        async def _produce(self, topic: str, value: bytes | None, key: str | None,
                           headers: Mapping[str, str],
                           extra: Sequence[tuple[str, Any]] = ()) -> None: ...

    async def _group(self, group: str, topics: tuple[str, ...]) -> GroupState:
        state = self._groups.get(group)
        if state is not None and state.topics == topics:
            return state
        if state is None:
            consumer = aiokafka.AIOKafkaConsumer(
                bootstrap_servers=self.bootstrap_servers,
                auto_offset_reset="earliest",
                **self._consumer_config,
                group_id=group,
                enable_auto_commit=False,
            )
            state = GroupState(await self._started(consumer, "consumer"))
            self._groups[group] = state
        state.topics = topics
        state.retry_topics = {self.retry_topic(t): t for t in topics}
        wanted = [*topics, *state.retry_topics]
        producer = await self._ready_producer()
        for topic in wanted:  # a cluster that auto-creates topics creates them now
            with contextlib.suppress(errors.KafkaError, TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(producer.partitions_for(topic), self.connect_timeout)
        state.consumer.subscribe(topics=wanted, listener=_Rebalance(self, state))
        return state

    async def _accept_batch(self, state: GroupState, group: str, batch: Mapping[Any, list[Any]],
                            now: float) -> tuple[list[Message], BrokerError | None]:
        """The messages of a ``getmany`` batch, partition by partition; a partition
        whose record could not be settled at fetch time is read again from it."""
        out: list[Message] = []
        failure: BrokerError | None = None
        for tp, records in batch.items():
            for record in records:
                try:
                    message, go_on = await self._accept(state, group, record, now)
                except BrokerError as exc:
                    failure = failure or exc
                    with contextlib.suppress(Exception):
                        state.consumer.seek(tp, record.offset)
                    break
                if message is not None:
                    out.append(message)
                if not go_on:
                    break  # the partition was paused at this record
        return out, failure

    async def _accept(self, state: GroupState, group: str, record: Any,
                      now: float) -> tuple[Message | None, bool]:
        """The message for ``record`` (or None) and whether the rest of its partition's
        batch may be read."""
        where = (record.topic, record.partition)
        if where in state.paused:
            return None, False
        tracker = state.tracker(where)
        view = view_of(record)
        verdict = judge(view, state.retry_topics, group, now,
                        limit=self.max_message_bytes, bounds=self.wire_bounds(group))
        if verdict.action == "reject":
            assert verdict.problem is not None
            letter, unreadable = malformed_letter(view, verdict.topic, group,
                                                  verdict.problem, now,
                                                  too_large=verdict.too_large)
            log.warning("%s: %s %s dead-lettered: %s", group, verdict.topic, view.position,
                        escape_control(verdict.problem))
            await self._produce(self.dead_letter_topic(verdict.topic), view.value,
                                letter.message.key, codec.dead_letter_headers(letter),
                                extra=unreadable)
        if verdict.action == "wait":
            assert verdict.due_at is not None
            tp = aiokafka.TopicPartition(*where)
            state.consumer.seek(tp, record.offset)
            state.consumer.pause(tp)
            state.pause(where, verdict.due_at)
            return None, False
        tracker.delivered(record.offset)
        if verdict.action != "deliver":  # rejected (dead-lettered) or another group's
            tracker.settled(record.offset)
            return None, True
        message = verdict.message
        assert message is not None
        message.receipt = KafkaReceipt(group, record.topic, record.partition, record.offset,
                                   tracker.epoch)
        return message, True

    def _resume_due(self, state: GroupState, now: float) -> None:
        due = state.due(now)
        if due:
            state.consumer.resume(*(aiokafka.TopicPartition(*w) for w in due))

    def _on_assign(self, state: GroupState, partitions: list[Any]) -> None:
        state.assigned((tp.topic, tp.partition) for tp in partitions)

    async def _on_revoke(self, state: GroupState, partitions: list[Any]) -> None:
        """Commit the revoked partitions' settled prefix and forget them: their
        in-flight messages' settlements become no-ops."""
        positions = state.revoked((tp.topic, tp.partition) for tp in partitions)
        offsets = {aiokafka.TopicPartition(*where): o for where, o in positions.items()}
        if offsets:
            try:
                await state.consumer.commit(offsets)
            except errors.KafkaError as exc:
                log.warning("commit on revoke failed (%r); those records will be "
                            "redelivered", exc)

    def _commit_behind(self, group: str, state: GroupState) -> None:
        """Commit the moved prefixes in the background (one commit in flight per group,
        like the sync adapter's asynchronous commit): a fetch does not wait for it."""
        running = self._commits.get(group)
        if running is None or running.done():
            self._commits[group] = asyncio.get_running_loop().create_task(
                self._commit(state))

    async def _commit(self, state: GroupState, *, strict: bool = False) -> None:
        """Commit the settled prefixes that moved; a failure is logged and retried on
        the next fetch, or raised when ``strict``."""
        moved = state.moved()
        if not moved:
            return
        try:
            await state.consumer.commit(
                {aiokafka.TopicPartition(*where): o for where, o in moved.items()})
        except Exception as exc:  # in the background too: never an unretrieved error
            state.forget_commits(moved)
            if strict:
                if isinstance(exc, errors.KafkaError):
                    raise aiokafka_error(exc, "offset commit") from exc
                raise
            log.warning("offset commit failed (%r); retrying on the next fetch", exc)

    def _tracker(self, r: KafkaReceipt) -> OffsetTracker | None:
        state = self._groups.get(r.group)
        return None if state is None else state.current(r)

    def _stale(self, r: KafkaReceipt) -> bool:
        return self._tracker(r) is None

    def _settled(self, r: KafkaReceipt) -> None:
        tracker = self._tracker(r)
        if tracker is not None:
            tracker.settled(r.offset)
