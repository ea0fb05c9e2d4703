"""AsyncRabbitMQBroker: the :class:`~msgpatterns.aio.base.AsyncBroker` protocol on
RabbitMQ with aio-pika.

Same topology and wire format as the sync :class:`~msgpatterns.brokers.RabbitMQBroker`
(this module calls its naming, queue-argument, wire and decoding functions; it does not
copy them), so the two read each other's messages, retries and dead letters, and the
same dead-letter admin (:meth:`AsyncRabbitMQBroker.dead_letter_admin`, ``msgpatterns
dlq``) manages both:

* exchange ``T`` (fanout, durable); queue ``T.G`` (durable, quorum by default) bound to
  it; ``T.G.retry.<ms>`` TTL queues dead-lettering back to ``T.G`` (a delayed retry
  needs no plugin); ``T.G.dlq`` dead letters with the full record in the headers.
* Manual acks, at most ``prefetch`` unacked deliveries (``basic_qos``).
* A retry or dead letter is published with publisher confirms *before* the original is
  acked: a crash in between duplicates it, never loses it; when that publish fails the
  delivery is handed back (``basic_nack`` with requeue) before the error is raised.
* The attempt number is durable: the attempt header written on every retry, plus the
  quorum queue's ``x-delivery-count`` for deliveries that died with their consumer.
* A delivery whose attempt or delivery-count header is not a valid count is
  dead-lettered with the reason; the consumer goes on.
* :meth:`publish` raises :class:`~msgpatterns.errors.UnroutableError` when nothing
  would keep the message (no exchange, no queue bound).
* :meth:`close` hands back prefetched deliveries and closes the connection (unacked
  deliveries go back to their queues); afterwards every operation raises
  :class:`~msgpatterns.errors.BrokerClosed`.

The connection is aio-pika's robust connection (it reconnects); deliveries of a lost
connection go back to their queue on the server and their late acks fail (they are
redelivered, never settled twice).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from msgpatterns._escape import escape_control
from msgpatterns._extras import require
from msgpatterns.aio._adapter import AsyncBrokerAdapter
from msgpatterns.brokers import _codec as codec
from msgpatterns.brokers._ack_window import AckWindow
from msgpatterns.brokers.rabbitmq import (
    RabbitMQBroker,
    dead_letter_queue_arguments,
    dead_letter_wire,
    delay_bucket_ms,
    redelivery_wire,
    retry_queue_arguments,
    take_round_robin,
)
from msgpatterns.deadletter import DeadLetter
from msgpatterns.delivery import receipt_of
from msgpatterns.errors import (
    BrokerError,
    BrokerUnavailable,
    ConfigurationError,
    UnroutableError,
    describe,
    seconds,
)
from msgpatterns.message import Message

aio_pika = require("aio_pika", "rabbitmq")

if TYPE_CHECKING:
    from msgpatterns.brokers.admin.rabbitmq import RabbitMQDeadLetters

__all__ = ["AsyncRabbitMQBroker"]

#: Named in the error for a message this adapter did not deliver.
_OWNER = "an AsyncRabbitMQBroker"

log = logging.getLogger("msgpatterns.aio.rabbitmq")

_AUTH_ERRORS = (aio_pika.exceptions.ProbableAuthenticationError,
                aio_pika.exceptions.AuthenticationError)


@dataclass(frozen=True, slots=True)
class _Receipt:
    incoming: Any  # the aio_pika IncomingMessage
    queue: str
    group: str


def _amqp_message(payload: bytes, props: Any) -> Any:
    """An aio-pika message from the sync adapter's wire (payload, pika properties)."""
    return aio_pika.Message(payload, headers=props.headers, message_id=props.message_id,
                            delivery_mode=props.delivery_mode, timestamp=props.timestamp)


def _message(topic: str, incoming: Any) -> Message:
    """The sync adapter's decoding (``RabbitMQBroker._message``) of an aio-pika delivery;
    raises MalformedMessage naming a bad header."""
    stamp = incoming.timestamp
    method = SimpleNamespace(redelivered=incoming.redelivered)
    properties = SimpleNamespace(
        headers=incoming.headers, message_id=incoming.message_id,
        timestamp=int(stamp.timestamp()) if stamp is not None else None)
    return RabbitMQBroker._message(topic, method, properties, incoming.body)


class AsyncRabbitMQBroker(AsyncBrokerAdapter):
    """The async Broker protocol on RabbitMQ (see the module docstring).

    Args:
        url: an ``amqp://`` URL (the broker owns its connection).
        prefetch: most unacked deliveries held at once; use the consumer's
            ``max_in_flight``.
        exchange: exchange name template (``{topic}``).
        queue: the group queue name template (``{topic}``, ``{group}``).
        queue_type: ``"quorum"`` (default), ``"classic"``, or None (existing queues).
        declare: declare exchanges, queues and bindings (False: they must exist).
        name: connection name shown in the management UI.
        connect_timeout: seconds to connect before raising
            :class:`~msgpatterns.errors.BrokerUnavailable`.
    """

    def __init__(self, url: str, *, prefetch: int = 100, exchange: str = "{topic}",
                 queue: str = "{topic}.{group}", queue_type: str | None = "quorum",
                 declare: bool = True, name: str | None = None,
                 connect_timeout: float = 5.0) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ConfigurationError(f"prefetch must be an integer >= 1, got {prefetch!r}")
        if not isinstance(url, str):
            raise ConfigurationError(f"url must be an amqp:// URL, got {type(url).__name__}")
        self.url = url
        self.prefetch = prefetch
        self.exchange_template = exchange
        self.queue_template = queue
        self.queue_type = queue_type
        self.declare = declare
        self.name = name or f"msgpatterns-async-{uuid.uuid4().hex[:8]}"
        self.connect_timeout = seconds(connect_timeout) or 5.0
        self._connection: Any = None
        self._channel: Any = None  # deliveries and their acks
        self._side: Any = None  # confirmed publishes and declarations
        self._connecting = asyncio.Lock()
        self._declared: set[str] = set()
        self._consumers: dict[str, tuple[Any, str]] = {}  # queue -> (queue object, tag)
        self._buffers: dict[str, deque[Message]] = {}
        self._arrived = asyncio.Condition()
        self._tags = itertools.count(1)
        self._callbacks: set[asyncio.Task[Any]] = set()  # deliveries being taken in
        self._closed = False
        # Batched acks, per channel (delivery tags are per channel): the settled tags,
        # the acks awaiting the next flush, and the flush task (one at a time).
        self._windows: dict[Any, AckWindow] = {}
        self._ack_waiters: dict[Any, list[asyncio.Future[None]]] = {}
        self._flushing: asyncio.Task[None] | None = None

    # -- names (the sync adapter's) ------------------------------------------------------

    def exchange_name(self, topic: str) -> str:
        return self.exchange_template.format(topic=topic)

    def queue_name(self, topic: str, group: str) -> str:
        return self.queue_template.format(topic=topic, group=group)

    # -- AsyncBroker protocol ---------------------------------------------------------

    async def _publish(self, topic: str, payload: bytes, key: str | None,
                       headers: Mapping[str, str]) -> str:
        """Publish to the topic's exchange and wait for the confirm. Raises
        UnroutableError when nothing would keep it (nothing is declared)."""
        message_id = uuid.uuid4().hex
        props = RabbitMQBroker._properties(message_id, codec.wire_headers(headers, key=key))
        side = await self._side_channel()
        exchange = await side.get_exchange(self.exchange_name(topic), ensure=False)
        await self._send(exchange, topic, _amqp_message(payload, props),
                         what=f"exchange {self.exchange_name(topic)!r}")
        return message_id

    async def subscribe(self, topic: str, group: str) -> None:
        """Declare the topic's exchange and ``group``'s queue and binding now."""
        self._check_open()
        await self._declare_group(topic, group)

    async def _fetch_messages(self, topics: list[str], group: str, max_messages: int,
                             timeout: float) -> list[Message]:
        """Up to ``max_messages`` deliveries of ``group``'s queues, waiting up to
        ``timeout`` seconds for the first."""
        self._check_open()
        queues = []
        for topic in topics:
            queues.append(await self._start_consuming(topic, group))
        out: list[Message] = []
        give_up = time.monotonic() + timeout
        async with self._arrived:
            while True:
                take_round_robin(self._buffers, queues, out, max_messages)
                left = give_up - time.monotonic()
                if out or left <= 0 or self._closed:
                    return out
                try:
                    await asyncio.wait_for(self._arrived.wait(), left)
                except TimeoutError:
                    return out

    async def ack(self, message: Message) -> None:
        """Ack the delivery; returns once the ack was written. Acks of one event-loop
        turn go out together: the channel's contiguous settled prefix as one
        ``basic_ack(multiple=True)`` (one quorum-queue command), settled tags above an
        unsettled one singly; a delivery not settled is never covered."""
        r = receipt_of(message, _Receipt, _OWNER)
        channel = r.incoming.channel
        if not self._window(channel).ack(r.incoming.delivery_tag):
            return  # not an unsettled delivery of this channel: nothing to send
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._ack_waiters.setdefault(channel, []).append(done)
        if self._flushing is None:
            self._flushing = asyncio.get_running_loop().create_task(self._send_acks())
        try:
            await asyncio.shield(done)
        except Exception as exc:
            raise BrokerError(f"{self.name}: ack of {message.id} failed (its connection "
                              f"is gone: it is redelivered): {describe(exc)}") from exc

    def _window(self, channel: Any) -> AckWindow:
        window = self._windows.get(channel)
        if window is None:
            window = self._windows[channel] = AckWindow()
        return window

    async def _send_acks(self) -> None:
        """Send what the acks of this loop turn settled, channel by channel, and wake
        their callers (with the channel's error, if sending failed)."""
        await asyncio.sleep(0)  # the acks of the same turn join this flush
        self._flushing = None
        waiters, self._ack_waiters = self._ack_waiters, {}
        for channel, window in list(self._windows.items()):
            upto, singles = window.take()
            error: BaseException | None = None
            try:
                if upto is not None:
                    await channel.basic_ack(upto, multiple=True)
                for tag in singles:
                    await channel.basic_ack(tag)
            except Exception as exc:
                error = exc
            if channel.is_closed:  # its deliveries went back to the queue
                self._windows.pop(channel, None)
            for done in waiters.pop(channel, []):
                if not done.done():
                    if error is None:
                        done.set_result(None)
                    else:
                        done.set_exception(error)
        for rest in waiters.values():  # a channel forgotten meanwhile
            for done in rest:
                if not done.done():
                    done.set_exception(BrokerError("the channel is gone"))

    async def nack(self, message: Message, delay: float = 0.0) -> None:
        """Redeliver after ``delay`` seconds (through a TTL retry queue) with
        ``attempt + 1``, the original payload and id, and the current headers."""
        r = receipt_of(message, _Receipt, _OWNER)
        try:
            checked = seconds(delay) or 0.0
            ms = delay_bucket_ms(checked) if checked > 0 else 0
        except ConfigurationError:
            await self._hand_back(r)
            raise
        await self._move(r, message, ms)

    async def dead_letter(self, message: Message, record: DeadLetter) -> None:
        """Publish the record to the group's dead-letter queue (confirmed), then ack."""
        r = receipt_of(message, _Receipt, _OWNER)
        try:
            payload, props = dead_letter_wire(record)
            dlq = await self._declare_queue(
                RabbitMQBroker.dead_letter_queue_name(r.queue),
                dead_letter_queue_arguments(self.queue_type))
            side = await self._side_channel()
            await self._send(side.default_exchange, dlq, _amqp_message(payload, props),
                             what=f"queue {dlq!r}")
        except BaseException:
            await self._hand_back(r)
            raise
        await self.ack(message)

    async def close(self) -> None:
        """Cancel the consumers, give back prefetched deliveries (their attempt
        unchanged), close the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        async with self._arrived:
            self._arrived.notify_all()
        try:
            for queue, tag in list(self._consumers.values()):
                try:
                    await queue.cancel(tag)
                except Exception:
                    log.debug("%s: cancelling consumer %s failed", self.name, tag,
                              exc_info=True)
            while self._callbacks:  # a malformed delivery being dead-lettered, ...
                await asyncio.wait(list(self._callbacks))
            for buffer in self._buffers.values():
                while buffer:
                    await self._give_back(buffer.popleft())
        finally:
            if self._connection is not None:
                await self._connection.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def dead_letter_admin(self) -> RabbitMQDeadLetters:
        """The sync admin of the groups' dead-letter queues (short-lived connections of
        its own to the same server, the same name templates)."""
        from msgpatterns.brokers.admin.rabbitmq import RabbitMQDeadLetters

        return RabbitMQDeadLetters(self.url, exchange=self.exchange_template,
                                   queue=self.queue_template, check=self._check_open)

    # -- internals --------------------------------------------------------------------

    async def _connect(self) -> None:
        async with self._connecting:
            if self._connection is not None:
                return
            try:
                connection = await aio_pika.connect_robust(
                    self.url, timeout=self.connect_timeout,
                    client_properties={"connection_name": self.name})
            except _AUTH_ERRORS as exc:
                raise BrokerUnavailable(f"RabbitMQ refused the credentials: {exc}") from exc
            except Exception as exc:
                raise BrokerUnavailable(
                    f"cannot connect to RabbitMQ within {self.connect_timeout:g}s: "
                    f"{describe(exc) or type(exc).__name__}") from exc
            channel = await connection.channel(publisher_confirms=False)
            await channel.set_qos(prefetch_count=self.prefetch)
            self._channel = channel
            self._connection = connection

    async def _side_channel(self) -> Any:
        """The confirm-mode channel for publishes and declarations (reopened when the
        server closed it, e.g. after a publish to a missing exchange)."""
        await self._connect()
        if self._side is None or self._side.is_closed:
            self._side = await self._connection.channel(publisher_confirms=True)
        return self._side

    async def _send(self, exchange: Any, routing_key: str, message: Any, *,
                    what: str) -> None:
        """Publish (mandatory) and wait for the confirm; unroutable raises
        UnroutableError, any other failure BrokerError."""
        try:
            await exchange.publish(message, routing_key, mandatory=True)
        except aio_pika.exceptions.DeliveryError as exc:
            raise UnroutableError(f"{self.name}: nothing would keep a message sent to "
                                  f"{what} (no queue bound); nothing was sent") from exc
        except aio_pika.exceptions.ChannelNotFoundEntity as exc:
            self._side = None
            raise UnroutableError(f"{self.name}: {what} does not exist (no group has "
                                  f"subscribed to it yet); nothing was sent") from exc
        except Exception as exc:
            self._side = None
            raise BrokerError(f"{self.name}: publish to {what} failed: {describe(exc)}"
                              ) from exc

    async def _declare_group(self, topic: str, group: str) -> str:
        side = await self._side_channel()
        exchange_name = self.exchange_name(topic)
        queue = await self._declare_queue(self.queue_name(topic, group),
                                          {} if self.queue_type is None
                                          else {"x-queue-type": self.queue_type})
        if self.declare and f"bind:{queue}" not in self._declared:
            await side.declare_exchange(exchange_name, aio_pika.ExchangeType.FANOUT,
                                        durable=True)
            bound = await side.get_queue(queue, ensure=False)
            await bound.bind(exchange_name, routing_key=topic)
            self._declared.add(f"bind:{queue}")
        return queue

    async def _declare_queue(self, name: str, arguments: dict[str, Any],
                             always: bool = False) -> str:
        if self.declare and (always or f"queue:{name}" not in self._declared):
            side = await self._side_channel()
            await side.declare_queue(name, durable=True, arguments=arguments)
            self._declared.add(f"queue:{name}")
        return name

    async def _start_consuming(self, topic: str, group: str) -> str:
        queue_name = self.queue_name(topic, group)
        if queue_name in self._consumers:
            return queue_name
        await self._declare_group(topic, group)
        queue = await self._channel.get_queue(queue_name, ensure=False)
        tag = f"{self.name}-{next(self._tags)}"

        async def on_message(incoming: Any) -> None:
            task = asyncio.current_task()
            if task is not None:
                self._callbacks.add(task)
            try:
                await self._on_message(incoming, topic, queue_name, group)
            finally:
                self._callbacks.discard(task)

        await queue.consume(on_message, no_ack=False, consumer_tag=tag)
        self._consumers[queue_name] = (queue, tag)
        return queue_name

    async def _on_message(self, incoming: Any, topic: str, queue: str, group: str) -> None:
        """A delivery: buffered for fetch, or dead-lettered with the reason when it
        cannot become a Message. Never raises."""
        self._window(incoming.channel).delivered(incoming.delivery_tag)
        receipt = _Receipt(incoming, queue, group)
        try:
            message = _message(topic, incoming)
        except Exception as exc:
            await self._dead_letter_malformed(receipt, topic, exc)
            return
        message.receipt = receipt
        if self._closed:
            await self._give_back(message)
            return
        async with self._arrived:
            self._buffers.setdefault(queue, deque()).append(message)
            self._arrived.notify_all()

    async def _dead_letter_malformed(self, r: _Receipt, topic: str, error: Exception) -> None:
        log.warning("%s: a delivery of %s is malformed (%s); dead-lettering it",
                    self.name, r.queue, escape_control(describe(error)))
        try:
            headers = codec.split_transport(r.incoming.headers or {}).headers
        except Exception:
            headers = {}
        message = Message(r.incoming.body, id=r.incoming.message_id or None, topic=topic,
                          headers=headers)
        message.receipt = r
        record = DeadLetter.from_error(message, error, now=time.time(),
                                       reason=describe(error), group=r.group)
        try:
            await self.dead_letter(message, record)
        except Exception:
            log.exception("%s: dead-lettering a malformed delivery failed", self.name)

    async def _move(self, r: _Receipt, message: Message, delay_ms: int,
                    attempt: int | None = None) -> None:
        """Publish the redelivery copy (through a retry queue when delayed), confirmed,
        then ack; on failure hand the delivery back and raise."""
        try:
            payload, props = redelivery_wire(message, r.group, attempt)
            target = r.queue
            if delay_ms > 0:
                target = await self._declare_queue(
                    RabbitMQBroker.retry_queue_name(r.queue, delay_ms),
                    retry_queue_arguments(r.queue, delay_ms, self.queue_type), always=True)
            side = await self._side_channel()
            await self._send(side.default_exchange, target,
                             _amqp_message(payload, props), what=f"queue {target!r}")
        except BaseException:
            await self._hand_back(r)
            raise
        await self.ack(message)

    async def _give_back(self, message: Message) -> None:
        """A prefetched delivery no handler saw goes back with its own attempt number
        (a requeue would count as an attempt on a quorum queue)."""
        try:
            await self._move(receipt_of(message, _Receipt, _OWNER), message, 0,
                             attempt=message.attempt)
        except Exception:
            log.warning("%s: giving back %s failed; the server redelivers it", self.name,
                        message.id, exc_info=True)

    async def _hand_back(self, r: _Receipt) -> None:
        """Return the delivery to its queue (a settlement failed or was refused)."""
        try:
            await r.incoming.nack(requeue=True)
            self._window(r.incoming.channel).gone(r.incoming.delivery_tag)
        except Exception:
            log.debug("%s: handing back a delivery failed (its connection is gone: the "
                      "server requeued it)", self.name, exc_info=True)

    def __repr__(self) -> str:
        return f"AsyncRabbitMQBroker(name={self.name!r})"
