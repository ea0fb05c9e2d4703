"""KafkaDeadLetters: the dead-letter admin of Kafka.

Dead letters of every group are records of ``<topic>.DLT``, each carrying the full
record. Kafka cannot delete a record, so replaying or purging one appends a *marker*
record (its headers name the positions it removes, see
:func:`msgpatterns.brokers.codec.removal_marker_headers`) that hides it from later
listings; retention removes the records themselves. A replay goes to
``<topic>.retry`` for the group that dead-lettered it (due at once) or to ``<topic>``
for every group, and the marker is written only after the replay was confirmed.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from msgpatterns.brokers import codec
from msgpatterns.brokers.admin.base import ScannedDeadLetters
from msgpatterns.brokers.kafka._link import kafka
from msgpatterns.brokers.kafka.broker import KafkaBroker
from msgpatterns.deadletter import DeadLetter, body_bytes

__all__ = ["KafkaDeadLetters"]


class KafkaDeadLetters(ScannedDeadLetters):
    """List, replay and purge the dead letters of Kafka topics, through ``broker``'s
    producer and configuration (a short-lived reader consumer per scan)."""

    def __init__(self, broker: KafkaBroker, *, owns_broker: bool = False) -> None:
        self._broker = broker
        self._owns_broker = owns_broker

    @classmethod
    def connect(cls, url: str, **options: Any) -> KafkaDeadLetters:
        """An admin on a :class:`~msgpatterns.brokers.KafkaBroker` of its own
        (``KafkaBroker(url, **options)``), closed by :meth:`close`."""
        return cls(KafkaBroker(url, **options), owns_broker=True)

    def close(self) -> None:
        """Close the broker this admin opened for itself (an async adapter's); a broker
        it was given stays open."""
        if self._owns_broker:
            self._broker.close()

    def knows(self, topic: str, group: str | None = None) -> bool:
        b = self._broker
        with b.operation("knows"):
            names = b.topic_names()
            return topic in names or b.dead_letter_topic(topic) in names

    def _scan(self, topic: str) -> list[DeadLetter]:
        with self._broker.operation("list_dead_letters"):
            records: list[DeadLetter] = []
            removed: set[tuple[str, str]] = set()
            for headers, letter in self._records(topic):
                if letter is None:
                    removed.update(codec.removed_positions(headers) or ())
                else:
                    records.append(letter)
            return [r for r in records
                    if (r.extra["dlt_partition"], r.extra["dlt_offset"]) not in removed]

    def _replay(self, topic: str, record: DeadLetter, owner: str | None) -> None:
        b = self._broker
        with b.operation("replay_dead_letters"):
            payload = body_bytes(record.message.raw_body)
            if owner is None:
                b.produce(topic, payload, record.message.key, codec.replay_headers(record))
            else:
                b.produce(b.retry_topic(topic), payload, record.message.key,
                           codec.replay_headers(record, group=owner, due_at=b.now()))
            self._mark_removed(topic, [record])

    def _remove(self, topic: str, records: Sequence[DeadLetter]) -> None:
        with self._broker.operation("purge_dead_letters"):
            self._mark_removed(topic, records)

    def _mark_removed(self, topic: str, records: Sequence[DeadLetter]) -> None:
        """Append a marker record that hides ``records`` from later listings."""
        self._broker.produce(
            self._broker.dead_letter_topic(topic), b"", None,
            codec.removal_marker_headers(
                (int(r.extra["dlt_partition"]), int(r.extra["dlt_offset"])) for r in records))

    def _records(self, topic: str) -> Iterator[tuple[dict[str, str], DeadLetter | None]]:
        """Every record of ``<topic>.DLT`` up to its current end: (headers, dead
        letter), or (headers, None) for a removal marker."""
        b = self._broker
        dlt = b.dead_letter_topic(topic)
        reader = b.scan_consumer(f"msgpatterns-dlq-reader-{uuid.uuid4().hex[:8]}")
        try:
            ends = self._ends(reader, dlt)
            if not ends:
                return
            reader.assign([kafka.TopicPartition(dlt, p, kafka.OFFSET_BEGINNING) for p in ends])
            give_up = time.monotonic() + b.delivery_timeout
            while ends and time.monotonic() < give_up:
                for record in reader.consume(num_messages=500, timeout=0.5):
                    if record.error() is not None:
                        continue
                    partition, offset = record.partition(), record.offset()
                    if offset + 1 >= ends.get(partition, 0):
                        ends.pop(partition, None)
                    headers = {k: codec.text(v) for k, v in record.headers() or []}
                    if codec.removed_positions(headers) is not None:
                        yield headers, None
                        continue
                    yield headers, codec.read_dead_letter(
                        record.value() or b"", headers,
                        fallback_id=f"{dlt}-{partition}-{offset}", fallback_topic=topic,
                        location={"dlt_partition": str(partition), "dlt_offset": str(offset)},
                    )
        finally:
            reader.close()

    def _ends(self, reader: Any, dlt: str) -> dict[int, int]:
        """The end offset of each non-empty partition of ``dlt`` (none: no topic)."""
        timeout = self._broker.connect_timeout
        info = reader.list_topics(dlt, timeout=timeout).topics.get(dlt)
        if info is None or info.error is not None:
            return {}
        ends: dict[int, int] = {}
        for partition in info.partitions:
            low, high = reader.get_watermark_offsets(kafka.TopicPartition(dlt, partition),
                                                     timeout=timeout)
            if high > low:
                ends[partition] = high
        return ends

    def __repr__(self) -> str:
        return f"KafkaDeadLetters({self._broker!r})"
