"""Settle deliveries of a pika ``basic_consume`` callback you own, the RabbitMQBroker way.

The topology and wire format are the adapter's (:mod:`msgpatterns.brokers.rabbitmq.broker`):
exchange ``T`` (fanout) -> queue ``T.G``; a retry is published (confirmed) to the TTL
queue ``T.G.retry.<ms>``, which dead-letters it back to ``T.G`` when due, then the
delivery is acked; a dead letter is published (confirmed) to ``T.G.dlq`` with its full
record, then acked (``msgpatterns dlq`` lists and replays it). The attempt is the
attempt header plus the quorum queue's ``x-delivery-count``.

A loop::

    channel = connection.channel()
    loop = PikaLoop(channel, topic="orders", group="billing")
    channel.basic_qos(prefetch_count=50)
    channel.basic_consume(loop.declare(), loop.callback(charge, policy=policy))
    channel.start_consuming()

Publishes and declarations go on a side channel of the same connection (in confirm
mode): a refused one closes that channel, never your consume channel.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from msgpatterns.brokers import codec
from msgpatterns.brokers.loop import RawLoop, carry_out
from msgpatterns.brokers.rabbitmq._link import pika, publish_confirmed
from msgpatterns.brokers.rabbitmq._wire import (
    BROKER_HEADERS,
    dead_letter_queue_arguments,
    dead_letter_queue_name,
    dead_letter_wire,
    delay_bucket_ms,
    message_of,
    optional_text,
    redelivery_wire,
    retry_queue_arguments,
    retry_queue_name,
)
from msgpatterns.deadletter import DeadLetter
from msgpatterns.delivery import receipt_of
from msgpatterns.errors import BrokerError, describe
from msgpatterns.headers import WIRE_LIMITS, WireBounds
from msgpatterns.limits import (
    DEFAULT_MAX_MESSAGE_BYTES,
    check_max_message_bytes,
    check_message_size,
)
from msgpatterns.message import Message
from msgpatterns.retry import RetryPolicy
from msgpatterns.settlement import Decision

__all__ = ["PikaLoop"]


@dataclass(frozen=True, slots=True)
class _Tag:
    delivery_tag: int


class PikaLoop(RawLoop):
    """The settlement side of a pika ``BlockingChannel`` consumer.

    Guarantees (the adapter's): a retry or dead letter is confirmed by the server
    before the delivery is acked (a crash in between duplicates it, never loses it);
    if that publish fails, the delivery is handed back (``basic_nack`` with requeue)
    before the error is raised; a retry is never early (its delay rounded up into a
    TTL bucket) and reaches only this group's queue; ``message.id`` is the publisher's
    ``message_id`` (or the id header on copies) and survives retries.

    Args:
        channel: your ``pika`` ``BlockingChannel`` (deliveries and their acks).
        topic: as for ``RabbitMQBroker``.
        group: as for ``RabbitMQBroker``; ``queue`` and ``exchange`` are its name
            templates, ``queue_type`` its queue type, ``declare`` whether to declare.
        max_message_bytes: as for ``RabbitMQBroker``: a larger delivery is
            dead-lettered with the reason (default 16 MiB, None: no bound).
    """

    def __init__(self, channel: Any, *, topic: str, group: str,
                 exchange: str = "{topic}", queue: str = "{topic}.{group}",
                 queue_type: str | None = "quorum", declare: bool = True,
                 max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.max_message_bytes = check_max_message_bytes(max_message_bytes)
        self.channel = channel
        self.topic = topic
        self.group = group
        self.exchange = exchange.format(topic=topic)
        self.queue = queue.format(topic=topic, group=group)
        self.queue_type = queue_type
        self.declare_topology = declare
        self._side: Any = None

    # -- topology -------------------------------------------------------------------

    def declare(self) -> str:
        """Declare the exchange, the group's queue and its binding (as the adapter
        does); returns the queue name to ``basic_consume``."""
        if self.declare_topology:
            side = self._side_channel()
            side.exchange_declare(self.exchange, exchange_type="fanout", durable=True)
            args = {} if self.queue_type is None else {"x-queue-type": self.queue_type}
            side.queue_declare(self.queue, durable=True, arguments=args)
            side.queue_bind(self.queue, self.exchange, routing_key=self.topic)
        return self.queue

    # -- deliveries -----------------------------------------------------------------

    def message(self, method: Any, properties: Any, body: bytes, *,
                bounds: WireBounds = WIRE_LIMITS) -> Message | None:
        """The Message of a delivery (attempt from the attempt header and
        ``x-delivery-count``), or None when its headers are malformed or it is over
        ``max_message_bytes``: then it is dead-lettered with the reason. ``bounds``
        (:meth:`RetryPolicy.wire_bounds <msgpatterns.RetryPolicy.wire_bounds>`): an
        attempt header beyond them is ignored."""
        try:
            check_message_size(body, properties.headers, limit=self.max_message_bytes)
            message = message_of(self.topic, method, properties, body, bounds)
        except Exception as exc:
            self._bury_malformed(method, properties, body, exc)
            return None
        message.receipt = _Tag(method.delivery_tag)
        return message

    def callback(self, handler: Callable[[Message], Any], *, policy: RetryPolicy
                 ) -> Callable[[Any, Any, Any, bytes], None]:
        """An ``on_message_callback`` for ``basic_consume`` that runs ``handler`` on
        each delivery and settles it as the policy decides."""
        bounds = policy.wire_bounds()

        def on_message(channel: Any, method: Any, properties: Any, body: bytes) -> None:
            message = self.message(method, properties, body, bounds=bounds)
            if message is not None:
                self.handle(message, handler, policy=policy)
        return on_message

    def apply(self, message: Message, decision: Decision) -> None:
        """Carry out ``decision``: ``basic_ack``; the retry copy (attempt + 1) to
        ``T.G.retry.<ms>`` (or straight to ``T.G`` without delay), then the ack; or the
        dead letter to ``T.G.dlq``, then the ack."""
        carry_out(self, message, decision)

    # -- the settling half of the Broker protocol (what carry_out calls) --------------

    def ack(self, message: Message) -> None:
        tag = self._tag(message)
        try:
            self.channel.basic_ack(tag)
        except pika.exceptions.AMQPError as exc:  # the server redelivers it
            raise BrokerError(f"{self!r}: ack of delivery {tag} failed: "
                              f"{describe(exc) or type(exc).__name__}") from exc

    def nack(self, message: Message, delay: float = 0.0) -> None:
        """Redeliver after ``delay`` seconds through the TTL retry queue."""
        target = self.queue
        payload, fields = redelivery_wire(message, self.group)
        props = pika.BasicProperties(**fields)
        with self._or_hand_back(message):
            if delay > 0:
                target = self._declare_retry_queue(delay_bucket_ms(delay))
            publish_confirmed(self._side_channel(), "", target, payload, props,
                              who=repr(self))
        self.ack(message)

    def dead_letter(self, message: Message, record: DeadLetter) -> None:
        """Park ``record`` in ``T.G.dlq``, then ack."""
        payload, fields = dead_letter_wire(record)
        props = pika.BasicProperties(**fields)
        with self._or_hand_back(message):
            dlq = dead_letter_queue_name(self.queue)
            if self.declare_topology:
                self._side_channel().queue_declare(
                    dlq, durable=True, arguments=dead_letter_queue_arguments(self.queue_type))
            publish_confirmed(self._side_channel(), "", dlq, payload, props, who=repr(self))
        self.ack(message)

    def close(self) -> None:
        """Close the side channel (your channel and connection stay yours)."""
        side, self._side = self._side, None
        if side is not None and side.is_open:
            side.close()

    def __enter__(self) -> PikaLoop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"PikaLoop(queue={self.queue!r})"

    # -- internals --------------------------------------------------------------------

    def _side_channel(self) -> Any:
        side = self._side
        if side is None or not side.is_open:
            side = self.channel.connection.channel()
            side.confirm_delivery()
            self._side = side
        return side

    def _declare_retry_queue(self, delay_ms: int) -> str:
        name = retry_queue_name(self.queue, delay_ms)
        self._side_channel().queue_declare(
            name, durable=True,
            arguments=retry_queue_arguments(self.queue, delay_ms, self.queue_type))
        return name

    @contextmanager
    def _or_hand_back(self, message: Message) -> Iterator[None]:
        """A settlement step that must not strand the delivery: on failure, hand it
        back (``basic_nack`` with requeue) before the error propagates; pika's errors
        come out as :class:`~msgpatterns.errors.BrokerError`."""
        tag = self._tag(message)
        try:
            yield
        except BaseException as exc:
            if self.channel.is_open:
                with contextlib.suppress(pika.exceptions.AMQPError):
                    self.channel.basic_nack(tag, requeue=True)
            if isinstance(exc, pika.exceptions.AMQPError) and not isinstance(
                    exc, BrokerError):
                raise BrokerError(f"{self!r}: settling delivery {tag} failed: "
                                  f"{describe(exc) or type(exc).__name__}") from exc
            raise

    def _bury_malformed(self, method: Any, properties: Any, body: bytes,
                        error: Exception) -> None:
        try:
            headers = codec.split_transport(properties.headers or {},
                                            drop=BROKER_HEADERS).headers
        except Exception:
            headers = {}
        message = Message(body, id=optional_text(properties.message_id), topic=self.topic,
                          headers=headers)
        message.receipt = _Tag(method.delivery_tag)
        self.dead_letter(message, DeadLetter.from_error(
            message, error, now=time.time(), reason=describe(error), group=self.group))

    @staticmethod
    def _tag(message: Message) -> int:
        return receipt_of(message, _Tag, "this PikaLoop").delivery_tag

