"""AsyncRabbitMQBroker: the :class:`~msgpatterns.aio.base.AsyncBroker` protocol on
RabbitMQ with aio-pika.

Same topology and wire format as the sync :class:`~msgpatterns.brokers.RabbitMQBroker`
(both use the wire core, :mod:`msgpatterns.brokers.rabbitmq._wire`: names, queue
arguments, properties, decoding; nothing is copied), so the two read each other's
messages, retries and dead letters, and the same dead-letter admin
(:meth:`AsyncRabbitMQBroker.dead_letter_admin`, ``msgpatterns dlq``) manages both:

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

* Acks of one event-loop turn go out together (the ack window): the channel's
  contiguous settled prefix as one ``basic_ack(multiple=True)``, settled tags above an
  unsettled one singly, written by one task per channel at a time, so an ack never
  covers a delivery that is not settled and never names a tag the server has already
  forgotten. ``ack_window=False`` writes one ``basic_ack`` per delivery (the plain twin).
* A lost connection or consume channel (closed by the server, killed while idle, a
  ``PRECONDITION_FAILED``) is reopened by the next :meth:`fetch` (backoff between
  failed attempts, until :meth:`close`) and consumption resumes. Deliveries of the lost
  channel are back on their queue on the server: the prefetched ones are dropped, and
  late acks, nacks and dead letters of the others are dropped too (never sent on the new
  channel), so they are redelivered (at least once) rather than settled twice.
  Authentication failures are never retried: fetch raises
  :class:`~msgpatterns.errors.BrokerUnavailable`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from msgpatterns._escape import escape_control
from msgpatterns._extras import require
from msgpatterns.brokers import codec
from msgpatterns.brokers._adapter import admin_for
from msgpatterns.brokers._aio_adapter import AsyncBrokerAdapter
from msgpatterns.brokers._batch import failed, outgoing
from msgpatterns.brokers._reconnect import RECONNECT_BACKOFF
from msgpatterns.brokers.admin.base import DeadLetterAdmin
from msgpatterns.brokers.rabbitmq._amqp_link import AmqpLink
from msgpatterns.brokers.rabbitmq._wire import (
    dead_letter_queue_arguments,
    dead_letter_queue_name,
    dead_letter_wire,
    delay_bucket_ms,
    message_of,
    message_properties,
    redelivery_wire,
    retry_queue_arguments,
    retry_queue_name,
    take_round_robin,
)
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.delivery import receipt_of
from msgpatterns.errors import (
    BrokerError,
    BrokerUnavailable,
    ConfigurationError,
    UnroutableError,
    describe,
    seconds,
)
from msgpatterns.headers import WireBounds
from msgpatterns.limits import (
    DEFAULT_MAX_MESSAGE_BYTES,
    check_max_message_bytes,
    check_message_size,
)
from msgpatterns.message import Message

aio_pika = require("aio_pika", "rabbitmq")
import aiormq  # noqa: E402 - aio-pika's own transport, after the extra check

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
    link: AmqpLink  # the channel that delivered it (its acks go there, or nowhere)

    @property
    def tag(self) -> int:
        return int(self.incoming.delivery_tag)


def _amqp_message(payload: bytes, fields: dict[str, Any]) -> Any:
    """An aio-pika message from the wire core's payload and property fields."""
    return aio_pika.Message(payload, **fields)


def _message(topic: str, incoming: Any, bounds: WireBounds) -> Message:
    """The wire core's decoding (:func:`~._wire.message_of`) of an aio-pika delivery;
    raises MalformedMessage naming a bad header."""
    stamp = incoming.timestamp
    method = SimpleNamespace(redelivered=incoming.redelivered)
    properties = SimpleNamespace(
        headers=incoming.headers, message_id=incoming.message_id,
        timestamp=int(stamp.timestamp()) if stamp is not None else None)
    return message_of(topic, method, properties, incoming.body, bounds)


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
        ack_window: batch the acks of one loop turn (``basic_ack(multiple=True)`` over
            the settled prefix); False sends one ``basic_ack`` per delivery.
        max_message_bytes: the largest delivery (body plus headers) handed to the
            handler; a larger one is dead-lettered with the reason (a
            :class:`~msgpatterns.limits.MessageTooLarge`), its body kept (None: no
            bound; see :mod:`msgpatterns.limits`).
    """

    def __init__(self, url: str, *, prefetch: int = 100, exchange: str = "{topic}",
                 queue: str = "{topic}.{group}", queue_type: str | None = "quorum",
                 declare: bool = True, name: str | None = None,
                 connect_timeout: float = 5.0, ack_window: bool = True,
                 max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.max_message_bytes = check_max_message_bytes(max_message_bytes)
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ConfigurationError(f"prefetch must be an integer >= 1, got {prefetch!r}")
        if not isinstance(url, str):
            raise ConfigurationError(f"url must be an amqp:// URL, got {type(url).__name__}")
        if not isinstance(ack_window, bool):
            raise ConfigurationError(f"ack_window must be True or False, got {ack_window!r}")
        self.url = url
        self.prefetch = prefetch
        self.exchange_template = exchange
        self.queue_template = queue
        self.queue_type = queue_type
        self.declare = declare
        self.name = name or f"msgpatterns-async-{uuid.uuid4().hex[:8]}"
        self.connect_timeout = seconds(connect_timeout) or 5.0
        self.ack_window = ack_window
        self._connection: Any = None
        self._link: AmqpLink | None = None  # the consume channel, its acks, its consumers
        self._generation = 0  # links opened so far
        self._side: Any = None  # confirmed publishes and declarations
        self._connecting = asyncio.Lock()
        self._outage = 0  # failed reconnect attempts since the link was lost
        self._retry_at = 0.0  # no reconnect attempt before (monotonic; the backoff)
        self._declared: set[str] = set()
        self._buffers: dict[str, deque[Message]] = {}
        self._changed = asyncio.Event()  # a delivery arrived, the link was lost, closed
        self._tags = itertools.count(1)
        self._callbacks: set[asyncio.Task[Any]] = set()  # deliveries being taken in
        self._closed = False

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
        props = message_properties(message_id, codec.wire_headers(headers, key=key))
        side = await self._side_channel()
        exchange = await side.get_exchange(self.exchange_name(topic), ensure=False)
        await self._send(exchange, topic, _amqp_message(payload, props),
                         what=f"exchange {self.exchange_name(topic)!r}")
        return message_id

    async def publish_many(self, topic: str, items: Iterable[Any]) -> list[str]:
        """Publish ``items`` (bodies, or :class:`~msgpatterns.brokers.Outgoing` with key
        and headers) to the topic's exchange, all written before any confirm is awaited
        (batched publisher confirms: one wait for the batch, not one per message);
        returns the message ids in order, as :meth:`publish` would.

        The same semantics as the sync ``RabbitMQBroker.publish_many``: not atomic (the
        server confirms each message on its own); if any is nacked or returned as
        unroutable (no queue bound), :class:`~msgpatterns.brokers.PartialPublish` says
        which were confirmed (those are queued; the others may or may not be). A batch
        to an exchange that does not exist sends nothing (its ``__cause__`` is an
        :class:`~msgpatterns.errors.UnroutableError`). Never retried as a whole (that
        would duplicate the confirmed ones)."""
        self._check_open()
        batch = []
        for item in outgoing(items):
            message_id = uuid.uuid4().hex
            batch.append((message_id, body_bytes(item.body), message_properties(
                message_id, codec.wire_headers(item.headers, key=item.key))))
        if not batch:
            return []
        name = self.exchange_name(topic)
        try:
            side = await self._side_channel()
            raw = await side.get_underlay_channel()
        except BrokerError as exc:
            raise failed(topic, [None] * len(batch), exc) from exc

        async def send(payload: bytes, props: dict[str, Any]) -> None:
            message = _amqp_message(payload, props)
            # wait=False: queued for the writer without waiting for it to drain, so
            # the whole batch is written before the first confirm comes back
            await self._confirmed(raw.basic_publish(
                message.body, exchange=name, routing_key=topic,
                properties=message.properties, mandatory=True, wait=False),
                what=f"exchange {name!r}")

        # aiormq queues publishes under a FIFO lock in the order they start: the
        # batch's order (a key's order) is kept on the wire
        outcomes = await asyncio.gather(*(send(payload, props) for _, payload, props in batch),
                                        return_exceptions=True)
        ids = [mid if outcome is None else None
               for (mid, _, _), outcome in zip(batch, outcomes, strict=True)]
        errors = [o for o in outcomes if isinstance(o, BaseException)]
        if errors:
            raise failed(topic, ids, errors[0]) from errors[0]
        return [mid for mid, _, _ in batch]

    async def subscribe(self, topic: str, group: str) -> None:
        """Declare the topic's exchange and ``group``'s queue and binding now."""
        self._check_open()
        await self._declare_group(topic, group)

    async def _fetch_messages(self, topics: list[str], group: str, max_messages: int,
                             timeout: float) -> list[Message]:
        """Up to ``max_messages`` deliveries of ``group``'s queues, waiting up to
        ``timeout`` seconds for the first. A lost channel is reopened here (and its
        consumers started again); while that fails this returns nothing."""
        self._check_open()
        out: list[Message] = []
        give_up = time.monotonic() + timeout
        while True:
            link = await self._live_link(give_up)
            if link is None:  # reconnecting (backoff): nothing to hand out yet
                return out
            try:
                queues = [await self._start_consuming(link, topic, group)
                          for topic in topics]
            except Exception as exc:
                connection = self._connection
                if not (link.lost or link.channel.is_closed or connection is None
                        or connection.is_closed):
                    raise
                link.lose(exc)  # the connection died under the consume: reopen
                continue
            take_round_robin(self._buffers, queues, out, max_messages)
            left = give_up - time.monotonic()
            if out or left <= 0 or self._closed:
                return out
            self._changed.clear()  # checked above, no await since: no wake-up is lost
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return out
            self._check_open()

    async def ack(self, message: Message) -> None:
        """Ack the delivery; returns once the ack was written (see the module docstring
        for the ack window). The ack of a delivery whose channel is gone is dropped:
        the server redelivers it."""
        r = receipt_of(message, _Receipt, _OWNER)
        if not await r.link.ack(r.tag):
            log.debug("%s: the channel of %s is gone; the server redelivers it",
                      self.name, message.id)

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
        """Publish the record to the group's dead-letter queue (confirmed), then ack.
        A delivery whose channel is gone is left to its redelivery instead."""
        r = receipt_of(message, _Receipt, _OWNER)
        if r.link.lost:
            log.debug("%s: the channel of %s is gone; the server redelivers it",
                      self.name, message.id)
            return
        try:
            payload, props = dead_letter_wire(record)
            dlq = await self._declare_queue(
                dead_letter_queue_name(r.queue),
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
        unchanged), write the pending acks, close the connection. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._changed.set()
        link = self._link
        try:
            if link is not None and not link.lost:
                for queue, tag in list(link.consumers.values()):
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
                await link.flushed()
        finally:
            for buffer in self._buffers.values():
                buffer.clear()
            if self._connection is not None:
                try:
                    await self._connection.close()
                except Exception:
                    log.debug("%s: closing the connection failed", self.name, exc_info=True)

    @property
    def closed(self) -> bool:
        return self._closed

    def dead_letter_admin(self) -> DeadLetterAdmin:
        """The sync admin of the groups' dead-letter queues
        (:class:`~msgpatterns.brokers.rabbitmq.admin.RabbitMQDeadLetters`; short-lived
        connections of its own to the same server, the same name templates)."""
        return admin_for("msgpatterns.brokers.rabbitmq.admin:RabbitMQDeadLetters",
                         self.url, exchange=self.exchange_template,
                         queue=self.queue_template, check=self._check_open)

    # -- the connection and its consume channel ---------------------------------------

    async def _connect(self) -> AmqpLink:
        """The live link: reuses the connection and channel when both are open, else
        opens what is gone (a new consume channel is a new link, with no consumers).
        Raises BrokerUnavailable."""
        async with self._connecting:
            link = self._link
            if link is not None and not link.lost:
                return link
            self._check_open()
            try:
                if not self._connection_usable():
                    await self._drop_connection()
                    connection = await aio_pika.connect(
                        self.url, timeout=self.connect_timeout,
                        client_properties={"connection_name": self.name})
                    connection.close_callbacks.add(self._on_connection_closed)
                    self._connection = connection
                channel = await self._connection.channel(publisher_confirms=False)
                await channel.set_qos(prefetch_count=self.prefetch)
                raw = await channel.get_underlay_channel()
            except _AUTH_ERRORS as exc:
                raise BrokerUnavailable(f"RabbitMQ refused the credentials: {exc}") from exc
            except Exception as exc:
                await self._drop_connection()  # the next attempt starts afresh
                raise BrokerUnavailable(
                    f"cannot connect to RabbitMQ within {self.connect_timeout:g}s: "
                    f"{describe(exc) or type(exc).__name__}") from exc
            self._generation += 1
            link = AmqpLink(self._generation, channel, raw, window=self.ack_window,
                            on_lost=self._on_link_lost)
            channel.close_callbacks.add(lambda _channel, exc=None: link.lose(exc))
            self._link = link
            if self._generation > 1:
                log.info("%s: reconnected (channel %d)", self.name, self._generation)
            return link

    async def _live_link(self, give_up: float) -> AmqpLink | None:
        """The live link, reopened if it was lost; None while reopening fails. Attempts
        are spaced by the reconnect backoff (a call inside it waits, at most until
        ``give_up``, instead of trying). The first connect and a refusal of the
        credentials raise BrokerUnavailable."""
        link = self._link
        if link is not None and not link.lost:
            return link
        now = time.monotonic()
        if now < self._retry_at:  # the backoff after a failed attempt: no new attempt
            await asyncio.sleep(min(self._retry_at, give_up) - now)
            if time.monotonic() < self._retry_at:
                return None
        try:
            link = await self._connect()
        except BrokerUnavailable as exc:
            if self._generation == 0 or isinstance(exc.__cause__, _AUTH_ERRORS):
                raise
            self._outage += 1
            if self._outage == 1:
                log.warning("%s: reconnecting to RabbitMQ failed (%s); retrying",
                            self.name, exc)
            self._retry_at = time.monotonic() + RECONNECT_BACKOFF.delay(self._outage)
            return None
        self._outage = 0
        return link

    async def _drop_connection(self) -> None:
        """Forget the connection (and its side channel), releasing what is left of it."""
        connection, self._connection, self._side = self._connection, None, None
        if connection is not None:
            try:
                await asyncio.wait_for(connection.close(), self.connect_timeout)
            except Exception:
                log.debug("%s: closing a lost connection failed", self.name, exc_info=True)

    def _connection_usable(self) -> bool:
        connection = self._connection
        return bool(connection is not None and not connection.is_closed
                    and connection.connected.is_set())

    def _on_connection_closed(self, connection: Any, exc: BaseException | None = None
                              ) -> None:
        if connection is not self._connection:
            return
        if self._link is not None:
            self._link.lose(exc)

    def _on_link_lost(self, link: AmqpLink, exc: BaseException | None) -> None:
        """``link``'s channel is gone (nothing more is written on it): its prefetched
        deliveries are dropped (the server redelivers them); fetch reopens."""
        for buffer in self._buffers.values():
            kept = [m for m in buffer
                    if isinstance(m.receipt, _Receipt) and m.receipt.link is not link]
            buffer.clear()
            buffer.extend(kept)
        if not self._closed:
            log.warning("%s: the RabbitMQ channel was closed (%s); reopening",
                        self.name, describe(exc) if exc else "no reason given")
        self._changed.set()

    async def _side_channel(self) -> Any:
        """The confirm-mode channel for publishes and declarations (reopened when the
        server closed it, e.g. after a publish to a missing exchange)."""
        if not self._connection_usable():
            await self._connect()
        if self._side is None or self._side.is_closed:
            try:
                self._side = await self._connection.channel(publisher_confirms=True)
            except Exception as exc:
                raise BrokerUnavailable(f"{self.name}: cannot open a channel: "
                                        f"{describe(exc)}") from exc
        return self._side

    async def _send(self, exchange: Any, routing_key: str, message: Any, *,
                    what: str) -> None:
        """Publish (mandatory) and wait for the confirm; unroutable (nacked, or returned:
        no queue bound) raises UnroutableError, any other failure BrokerError."""
        await self._confirmed(exchange.publish(message, routing_key, mandatory=True),
                              what=what)

    async def _confirmed(self, publishing: Awaitable[Any], *, what: str) -> None:
        """Await a publish until its confirm: :meth:`_send`'s outcomes."""
        try:
            result = await publishing
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
        if isinstance(result, aiormq.abc.DeliveredMessage):  # a basic.return
            raise UnroutableError(f"{self.name}: nothing would keep a message sent to "
                                  f"{what} (no queue bound); it was returned")

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

    async def _start_consuming(self, link: AmqpLink, topic: str, group: str) -> str:
        """Consume ``group``'s queue of ``topic`` on ``link`` (once per link)."""
        queue_name = self.queue_name(topic, group)
        if queue_name in link.consumers:
            return queue_name
        await self._declare_group(topic, group)
        queue = await link.channel.get_queue(queue_name, ensure=False)
        tag = f"{self.name}-{next(self._tags)}"

        async def on_message(incoming: Any) -> None:
            link.delivered(incoming.delivery_tag)  # before any await: in server order
            task = asyncio.current_task()
            if task is not None:
                self._callbacks.add(task)
            try:
                await self._on_message(link, incoming, topic, queue_name, group)
            finally:
                self._callbacks.discard(task)

        await queue.consume(on_message, no_ack=False, consumer_tag=tag)
        link.consumers[queue_name] = (queue, tag)
        return queue_name

    async def _on_message(self, link: AmqpLink, incoming: Any, topic: str, queue: str,
                          group: str) -> None:
        """A delivery: buffered for fetch, or dead-lettered with the reason when it
        cannot become a Message. Never raises."""
        if link.lost:
            return  # back on its queue on the server already
        receipt = _Receipt(incoming, queue, group, link)
        try:
            check_message_size(incoming.body, incoming.headers,
                               limit=self.max_message_bytes)
            message = _message(topic, incoming, self.wire_bounds(group))
        except Exception as exc:
            await self._dead_letter_malformed(receipt, topic, exc)
            return
        message.receipt = receipt
        if self._closed:
            await self._give_back(message)
            return
        self._buffers.setdefault(queue, deque()).append(message)
        self._changed.set()

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
        then ack; on failure hand the delivery back and raise. A delivery whose channel
        is gone is left to its redelivery (no copy: it would be a second one)."""
        if r.link.lost:
            log.debug("%s: the channel of %s is gone; the server redelivers it",
                      self.name, message.id)
            return
        try:
            payload, props = redelivery_wire(message, r.group, attempt)
            target = r.queue
            if delay_ms > 0:
                target = await self._declare_queue(
                    retry_queue_name(r.queue, delay_ms),
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
        """Return the delivery to its queue (a settlement failed or was refused); on a
        lost channel the server has it back already."""
        if not await r.link.nack(r.tag):
            log.debug("%s: handing back a delivery found its channel gone (the server "
                      "requeued it)", self.name)

    def __repr__(self) -> str:
        return f"AsyncRabbitMQBroker(name={self.name!r})"
