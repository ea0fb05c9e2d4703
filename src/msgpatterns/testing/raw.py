"""Drive raw-callback handlers (pika-shaped, confluent-kafka-shaped) from the fake broker.

Code that owns its consumer loop can be unit-tested against
:class:`~msgpatterns.InMemoryBroker` with its faults (duplicates, reordering, lost acks):

* :class:`FakePikaChannel` has the ``pika`` channel calls a ``basic_consume`` callback
  uses (``basic_qos``, ``basic_consume``, ``start_consuming``, ``basic_ack``,
  ``basic_nack``, ``basic_reject``). ``start_consuming()`` returns when nothing is
  left to deliver (virtual time jumps over visibility timeouts and delays).
* :class:`FakeKafkaConsumer` has the ``confluent_kafka.Consumer`` calls a poll loop
  uses (``subscribe``, ``poll``, ``commit``, ``close``); ``poll`` returns None when
  nothing is left.

Guarantees: an ack reaches the fake broker as an ack; ``basic_nack(requeue=True)`` is a
redelivery; ``basic_reject``/``basic_nack(requeue=False)`` a dead letter; a delivery
the callback never settles comes back after the broker's visibility timeout, as on a
real broker.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from msgpatterns._callables import require_sync_callable
from msgpatterns.brokers.memory.broker import InMemoryBroker
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.errors import ConfigurationError, Reject
from msgpatterns.message import Message

__all__ = ["FakeKafkaConsumer", "FakeKafkaRecord", "FakePikaChannel"]


def _advance_if_idle(broker: InMemoryBroker, topics: Sequence[str], group: str) -> bool:
    """Jump the virtual clock to the next due delivery; False when nothing is due."""
    due = broker.next_due(topics, group)
    if due is None:
        return False
    broker.advance_to(due)
    return True


class FakePikaChannel:
    """A pika ``BlockingChannel`` stand-in over an :class:`InMemoryBroker`.

    ``group`` plays the part of the queue's consumer group (each queue name is a topic).
    """

    def __init__(self, broker: InMemoryBroker, *, group: str = "test",
                 max_deliveries: int = 100_000) -> None:
        self.broker = broker
        self.group = group
        self.max_deliveries = max_deliveries
        self._callbacks: dict[str, Callable[..., Any]] = {}
        self._auto_ack: dict[str, bool] = {}
        self._unsettled: dict[int, Message] = {}
        self._tags = itertools.count(1)
        self._stopping = False
        self.prefetch_count = 0

    def basic_qos(self, prefetch_size: int = 0, prefetch_count: int = 0,
                  global_qos: bool = False) -> None:
        self.prefetch_count = prefetch_count

    def basic_consume(self, queue: str, on_message_callback: Callable[..., Any],
                      auto_ack: bool = False, **_: Any) -> str:
        require_sync_callable(on_message_callback, what="on_message_callback",
                              where="FakePikaChannel.basic_consume")
        if not queue:
            raise ConfigurationError("basic_consume needs a queue name")
        self._callbacks[queue] = on_message_callback
        self._auto_ack[queue] = auto_ack
        return f"ctag-{queue}"

    def start_consuming(self) -> None:
        """Deliver until nothing is left (or :meth:`stop_consuming` is called)."""
        if not self._callbacks:
            raise ConfigurationError("start_consuming before basic_consume")
        topics = list(self._callbacks)
        self._stopping = False
        delivered = 0
        while not self._stopping and delivered < self.max_deliveries:
            batch = self.broker.fetch(topics, self.group, max_messages=self.prefetch_count or 1)
            if not batch:
                # What the callback still holds comes back after the visibility timeout.
                self._unsettled.clear()
                if not _advance_if_idle(self.broker, topics, self.group):
                    return
                continue
            for message in batch:
                delivered += 1
                self._deliver(message)

    def stop_consuming(self) -> None:
        self._stopping = True

    def _deliver(self, message: Message) -> None:
        tag = next(self._tags)
        self._unsettled[tag] = message
        method = SimpleNamespace(delivery_tag=tag, redelivered=message.attempt > 1,
                                 routing_key=message.topic, exchange="",
                                 consumer_tag=f"ctag-{message.topic}")
        properties = SimpleNamespace(message_id=message.id, headers=dict(message.headers),
                                     correlation_id=message.key, timestamp=message.timestamp,
                                     content_type=None, delivery_mode=2)
        if self._auto_ack[message.topic]:
            self.basic_ack(tag)
        self._callbacks[message.topic](self, method, properties, body_bytes(message.raw_body))

    def _take(self, delivery_tag: int, multiple: bool) -> list[Message]:
        if multiple:
            tags = [t for t in self._unsettled if t <= delivery_tag]
        else:
            tags = [delivery_tag] if delivery_tag in self._unsettled else []
        return [self._unsettled.pop(t) for t in tags]

    def basic_ack(self, delivery_tag: int = 0, multiple: bool = False) -> None:
        for message in self._take(delivery_tag, multiple):
            self.broker.ack(message)

    def basic_nack(self, delivery_tag: int = 0, multiple: bool = False,
                   requeue: bool = True) -> None:
        for message in self._take(delivery_tag, multiple):
            if requeue:
                self.broker.nack(message, 0.0)
            else:
                self._dead_letter(message, "basic_nack(requeue=False)")

    def basic_reject(self, delivery_tag: int, requeue: bool = True) -> None:
        self.basic_nack(delivery_tag, requeue=requeue)

    def _dead_letter(self, message: Message, how: str) -> None:
        record = DeadLetter.from_error(message, Reject(how), now=self.broker.now(),
                                       reason=how, group=self.group)
        self.broker.dead_letter(message, record)


class FakeKafkaRecord:
    """The ``confluent_kafka.Message`` calls a poll loop reads."""

    def __init__(self, message: Message) -> None:
        self._message = message

    def value(self) -> bytes:
        return body_bytes(self._message.raw_body)

    def key(self) -> bytes | None:
        return None if self._message.key is None else self._message.key.encode("utf-8")

    def headers(self) -> list[tuple[str, bytes]]:
        return [(k, v.encode("utf-8")) for k, v in self._message.headers.items()]

    def topic(self) -> str:
        return self._message.topic

    def partition(self) -> int:
        return self._message.partition or 0

    def offset(self) -> int:
        return self._message.offset if self._message.offset is not None else -1

    def error(self) -> None:
        return None


class FakeKafkaConsumer:
    """A ``confluent_kafka.Consumer`` stand-in over an :class:`InMemoryBroker`.

    ``commit(message=record)`` acks that record; ``commit()`` acks every record polled
    so far. A record polled and never committed comes back after the broker's
    visibility timeout, as an uncommitted offset is re-read after a restart.
    """

    def __init__(self, broker: InMemoryBroker, *, group: str = "test") -> None:
        self.broker = broker
        self.group = group
        self._topics: list[str] = []
        self._polled: dict[int, Message] = {}
        self._closed = False

    def subscribe(self, topics: Sequence[str], **_: Any) -> None:
        if isinstance(topics, str) or not topics:
            raise ConfigurationError("subscribe takes a non-empty list of topics")
        self._topics = list(topics)

    def poll(self, timeout: float | None = None) -> FakeKafkaRecord | None:
        """The next record, or None when nothing is left (virtual time jumps over
        visibility timeouts and delays first)."""
        if self._closed:
            raise RuntimeError("consumer closed")
        while True:
            batch = self.broker.fetch(self._topics, self.group, max_messages=1)
            if batch:
                message = batch[0]
                self._polled[id(message)] = message
                return FakeKafkaRecord(message)
            if self._polled:  # uncommitted: re-read after the visibility timeout
                self._polled.clear()
            if not _advance_if_idle(self.broker, self._topics, self.group):
                return None

    def commit(self, message: FakeKafkaRecord | None = None, asynchronous: bool = True,
               **_: Any) -> None:
        if message is not None:
            # Identity of the record's Message: pop it from what was polled.
            polled = self._polled.pop(id(message._message), None)
            todo = [polled] if polled is not None else []
        else:
            todo, self._polled = list(self._polled.values()), {}
        for m in todo:
            self.broker.ack(m)

    def close(self) -> None:
        self._closed = True
