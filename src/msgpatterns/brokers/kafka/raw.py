"""Settle records of a confluent-kafka poll loop you own, the KafkaBroker way.

Your ``confluent_kafka.Consumer`` (``enable.auto.commit`` off) is run through the adapter
(:class:`~msgpatterns.brokers.KafkaBroker`): it is subscribed to your topics and their
``<topic>.retry`` topics with the adapter's rebalance callbacks, a retry is produced to
``<topic>.retry`` with the group and its due time (a retry partition whose next record
is not due yet is paused until it is), a dead letter to ``<topic>.DLT`` with its origin
and full record in headers (``msgpatterns dlq`` lists and replays it), and only the
contiguous settled prefix of each partition is committed.

A loop::

    loop = KafkaLoop(consumer, group="billing", topics=["orders"], producer=producer)
    while running:
        wait = loop.maintain()                  # resume due retries, commit the prefix
        record = consumer.poll(min(wait or 1.0, 1.0))
        message = loop.message(record) if record is not None else None
        if message is not None:
            loop.handle(message, charge, policy=policy)
    loop.close()                               # final commit; then consumer.close()
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from msgpatterns.brokers.kafka.broker import KafkaBroker
from msgpatterns.brokers.loop import RawLoop, carry_out
from msgpatterns.limits import DEFAULT_MAX_MESSAGE_BYTES
from msgpatterns.message import Message
from msgpatterns.settlement import Decision

__all__ = ["KafkaLoop"]


class KafkaLoop(RawLoop):
    """The settlement side of a confluent-kafka poll loop.

    Guarantees (the adapter's): the committed offset of a partition never passes an
    unsettled record, whatever order settlements come in; a retry or dead letter is
    confirmed by the cluster before its record counts as settled; retries are never
    early and reach only this group; after a rebalance, settlements of revoked records
    are ignored (their new owner reads them again). Kafka keeps no delivery count: the
    attempt is the attempt header.

    Args:
        consumer: your ``confluent_kafka.Consumer`` (auto-commit off; not closed here).
            It is subscribed to ``topics`` and their retry topics now.
        group: its ``group.id`` (retries are addressed to it).
        topics: the topics to consume.
        producer: a ``confluent_kafka.Producer`` (not closed here) or a librdkafka
            configuration for one the loop creates and closes.
        retry_suffix: as for ``KafkaBroker``.
        dead_letter_suffix: as for ``KafkaBroker``.
        delivery_timeout: as for ``KafkaBroker``.
        max_message_bytes: as for ``KafkaBroker``: a larger record is dead-lettered
            with the reason (default 16 MiB, None: no bound).
    """

    def __init__(self, consumer: Any, *, group: str, topics: Sequence[str],
                 producer: Any, retry_suffix: str = ".retry",
                 dead_letter_suffix: str = ".DLT", delivery_timeout: float = 30.0,
                 max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        options: dict[str, Any] = {"retry_suffix": retry_suffix,
                                   "dead_letter_suffix": dead_letter_suffix,
                                   "delivery_timeout": delivery_timeout,
                                   "max_message_bytes": max_message_bytes}
        if isinstance(producer, Mapping):
            self.broker = KafkaBroker(producer, **options)
        else:
            self.broker = KafkaBroker({}, producer=producer, **options)
        self.group = group
        self.consumer = consumer
        self._state = self.broker.adopt(group, consumer, list(topics))

    def message(self, record: Any) -> Message | None:
        """The Message of a polled record, or None when it is not one to handle now: an
        error/EOF event, another group's retry, a retry not yet due (its partition is
        paused and rewound to it), or a malformed record (dead-lettered with the reason).
        If dead-lettering a malformed record fails, its partition is rewound to it and
        the :class:`~msgpatterns.errors.BrokerError` raised."""
        return self.broker.message_of(self._state, self.group, record)

    def apply(self, message: Message, decision: Decision) -> None:
        """Carry out ``decision``: mark the record settled; produce the retry to
        ``<topic>.retry`` (due after the delay, for this group) and then mark it
        settled; or produce the dead letter to ``<topic>.DLT`` and then mark it settled.
        The settled prefix is committed by :meth:`maintain`, :meth:`commit` or
        :meth:`close`."""
        carry_out(self.broker, message, decision)

    def maintain(self) -> float | None:
        """Call once per loop turn: resume retry partitions whose record is now due and
        commit the settled prefixes that moved (asynchronously). Returns seconds until
        the next paused retry is due (None: none paused), to cap your poll timeout."""
        return self.broker.maintain(self._state)

    def commit(self) -> dict[tuple[str, int], int]:
        """Commit the settled prefixes now (synchronously), failing loudly
        (:class:`~msgpatterns.errors.BrokerError`); returns the committed position of
        each partition that has one."""
        return self.broker.commit_group(self._state)

    def close(self) -> None:
        """Commit the settled prefixes, then release the adapter (the producer is
        flushed; closed only if this loop created it). The consumer stays yours: close
        it afterwards. Later calls raise :class:`~msgpatterns.errors.BrokerClosed`."""
        if self.broker.closed:
            return
        try:
            self.commit()
        finally:
            self.broker.release(self.group)
            self.broker.close()

    def __enter__(self) -> KafkaLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

