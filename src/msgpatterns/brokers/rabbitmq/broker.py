"""RabbitMQBroker: the Broker protocol on RabbitMQ (pika ``BlockingConnection``).

Topology, for a topic ``T`` and a consumer group ``G`` (names are templates):

* exchange ``T`` (fanout, durable) - what :meth:`RabbitMQBroker.publish` sends to;
* queue ``T.G`` (durable, quorum by default) bound to it - ``G``'s copy of every message;
* queues ``T.G.retry.<ms>`` - one per retry delay (rounded up to two significant
  digits), with that message TTL and a dead-letter route back to ``T.G``: a delayed
  retry needs no plugin, and a short delay never waits behind a long one;
* queue ``T.G.dlq`` - dead letters, each with its full record in the headers.

Guarantees:

* Manual acks, at most ``prefetch`` unacked deliveries per broker object (set it to the
  Consumer's ``max_in_flight``). Acks are batched: after each run of queued
  settlements, the contiguous settled prefix of the channel's delivery tags goes as one
  ``basic_ack(multiple=True)`` (one quorum-queue command, not one per message);
  settled tags above an unsettled one are acked singly. A tag not yet settled is never
  covered.
* Two channels on one connection: deliveries and their acks on the *consume* channel;
  publishes (with publisher confirms) and declarations on a *side* channel. A publish
  or declaration the server refuses closes at most the side channel, which is reopened
  on next use: it never costs a reconnect or a redelivery of anything in flight.
* :meth:`~RabbitMQBroker.publish` raises :class:`~msgpatterns.errors.UnroutableError`
  at once when nothing would keep the message (no such exchange, no queue bound); it
  declares nothing, so a failed publish leaves nothing behind.
* A retry or dead letter is published with publisher confirms *before* the original is
  acked: a crash in between duplicates it, never loses it. When that publish fails, the
  delivery is handed back (``basic_nack`` with requeue) before the error is raised: a
  delivery is never left unacked on the live channel. Every string put on the wire is
  made encodable first (lone surrogates escaped).
* ``message.id`` is the publisher's id (AMQP ``message_id``, or the library's id header
  on copies it republishes) or None; never a delivery tag. Retries and dead letters
  keep the original id and carry the attempt number.
* The attempt number is durable: the attempt header written on every retry, plus the
  quorum queue's ``x-delivery-count`` for deliveries that died with their consumer.
  (Classic queues only say "redelivered": such a redelivery counts as one attempt.)
* Header values are data: a delivery whose attempt or delivery-count header is not a
  valid count is dead-lettered (reason naming the header) by the adapter itself; other
  values of unusual types reach the handler as text. Nothing from the wire can stop
  the I/O thread.
* Thread-safe: pika connections are not, so one I/O thread owns the connection and
  every other thread hands it work (``add_callback_threadsafe``). ``ack`` does not
  wait; ``nack``, ``dead_letter`` and ``publish`` return once the broker confirmed.
* A lost connection is re-established (tenacity, until :meth:`close`). Deliveries of
  the lost connection go back to their queue on the server; their late acks and nacks
  are dropped, so they are redelivered (at least once) rather than settled twice.
  Authentication and permission failures are never retried: they raise
  :class:`~msgpatterns.errors.BrokerUnavailable` at once, with one line saying so.
* :meth:`~RabbitMQBroker.close` sends the queued acks (or raises
  :class:`~msgpatterns.errors.BrokerError` saying they could not be sent), hands back
  prefetched deliveries, and closes the connection; afterwards every operation raises
  :class:`~msgpatterns.errors.BrokerClosed` at once and nothing reconnects.
* Users see the library's errors (:class:`~msgpatterns.errors.BrokerError` and its
  subclasses, :class:`~msgpatterns.errors.ConfigurationError`), with pika's exception
  as the cause; a pika exception never escapes bare.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any, NamedTuple

from msgpatterns._callables import renamed_arguments
from msgpatterns._escape import escape_control
from msgpatterns.brokers import codec
from msgpatterns.brokers._adapter import BrokerAdapter, admin_for
from msgpatterns.brokers._batch import failed, outgoing
from msgpatterns.brokers._reconnect import reconnect_backoff, reconnecting
from msgpatterns.brokers.admin.base import DeadLetterAdmin
from msgpatterns.brokers.rabbitmq import _wire as wire
from msgpatterns.brokers.rabbitmq._ack_window import AckWindow
from msgpatterns.brokers.rabbitmq._channels import SideChannels
from msgpatterns.brokers.rabbitmq._io import IoThread
from msgpatterns.brokers.rabbitmq._link import (
    AUTH_ERRORS,
    CONNECTION_ERRORS,
    TRANSIENT,
    Confirms,
    basic_properties,
    pika,
    pika_errors,
    url_parameters,
)
from msgpatterns.brokers.rabbitmq._wire import (
    BROKER_HEADERS,
    MAX_DELAY_MS,
    delay_bucket_ms,
    optional_text,
    take_round_robin,
)
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.delivery import receipt_of
from msgpatterns.errors import (
    BrokerClosed,
    BrokerError,
    BrokerUnavailable,
    ConfigurationError,
    describe,
    seconds,
)
from msgpatterns.limits import (
    DEFAULT_MAX_MESSAGE_BYTES,
    check_max_message_bytes,
    check_message_size,
)
from msgpatterns.message import Message

__all__ = ["MAX_DELAY_MS", "RabbitMQBroker", "delay_bucket_ms"]

#: Named in the error for a message this adapter did not deliver.
_OWNER = "a RabbitMQBroker"

log = logging.getLogger("msgpatterns.brokers.rabbitmq")


class _Receipt(NamedTuple):
    """Which delivery of which connection (a tuple: built once per delivery on the
    I/O thread, so it is cheap to make)."""

    generation: int
    delivery_tag: int
    queue: str
    group: str


class RabbitMQBroker(IoThread, SideChannels, BrokerAdapter):
    """The :class:`~msgpatterns.brokers.base.Broker` protocol on RabbitMQ.

    Args:
        url: an ``amqp://`` URL or ``pika.ConnectionParameters`` (the old keyword
            ``url_or_parameters=`` still works). (The
            broker owns its connection: pika connections cannot be shared between
            threads, and a lost one must be replaced.)
        prefetch: most unacked deliveries held at once (``basic_qos``); use the
            Consumer's ``max_in_flight``.
        exchange: exchange name template (``{topic}``).
        queue: the group queue name template (``{topic}``, ``{group}``).
        queue_type: ``"quorum"`` (default: durable, counts redeliveries), ``"classic"``,
            or None to declare without a type (existing queues).
        declare: declare exchanges, queues and bindings (False: they must exist).
        name: connection name shown in the management UI.
        connect_timeout: seconds the constructor tries to connect before raising
            :class:`~msgpatterns.errors.BrokerUnavailable` (also pika's socket and
            stack timeouts for a URL that sets none).
        close_timeout: seconds :meth:`close` waits for the I/O thread to flush.
        max_message_bytes: the largest delivery (body plus headers) handed to the
            handler; a larger one is dead-lettered with the reason (a
            :class:`~msgpatterns.limits.MessageTooLarge`), its body kept (None: no
            bound; see :mod:`msgpatterns.limits`).
    """

    @renamed_arguments(url_or_parameters="url")
    def __init__(
        self,
        url: Any,
        *,
        prefetch: int = 100,
        exchange: str = "{topic}",
        queue: str = "{topic}.{group}",
        queue_type: str | None = "quorum",
        declare: bool = True,
        name: str | None = None,
        connect_timeout: float = 5.0,
        close_timeout: float = 10.0,
        max_message_bytes: int | None = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.max_message_bytes = check_max_message_bytes(max_message_bytes)
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ConfigurationError(f"prefetch must be an integer >= 1, got {prefetch!r}")
        connect_timeout = seconds(connect_timeout) or 0.0
        if connect_timeout <= 0:
            raise ConfigurationError("connect_timeout must be positive")
        self._close_timeout = seconds(close_timeout) or 0.0
        params = url_parameters(url, connect_timeout)
        self.name = name or f"msgpatterns-{uuid.uuid4().hex[:8]}"
        props = dict(params.client_properties or {})
        props.setdefault("connection_name", self.name)
        params.client_properties = props
        self._params = params
        self.prefetch = prefetch
        self.exchange_template = exchange
        self.queue_template = queue
        self.queue_type = queue_type
        self.declare = declare

        self._closed = threading.Event()
        self._failure: BrokerError | None = None  # why the I/O thread gave up for good
        self._close_error: BaseException | None = None
        self._ops: deque[tuple[Callable[[Any], Any], Future[Any] | None]] = deque()
        self._acked: list[_Receipt] = []  # acks handed over, not yet counted (_ops_lock)
        self._ops_lock = threading.Lock()
        self._wake_pending = False
        self._cond = threading.Condition(threading.Lock())
        self._buffers: dict[str, deque[Message]] = {}
        self._routes: dict[str, tuple[str, str]] = {}  # queue -> (topic, group)
        self._tags: dict[str, str] = {}  # consumer tag -> queue
        self._declared: set[str] = set()
        self._conn: Any = None
        self._channel: Any = None  # deliveries and their acks
        self._side: Any = None  # publishes (confirmed) and declarations
        self._batches: Confirms | None = None  # publish_many: confirms counted, not awaited
        self._generation = 0
        self._acks = AckWindow()  # the consume channel's settled tags (I/O thread only)
        self._ids = itertools.count(1)
        retrying = reconnecting(CONNECTION_ERRORS, logger=log, what="RabbitMQ connect",
                                attempts=None, within=connect_timeout,
                                backoff=reconnect_backoff(1.0), fatal=AUTH_ERRORS)
        try:
            self._connect(retrying)
        except BrokerError:
            raise
        except Exception as exc:
            raise BrokerUnavailable(
                f"cannot connect to RabbitMQ at {self._where()} within {connect_timeout:g}s:"
                f" {describe(exc) or type(exc).__name__}"
            ) from exc
        self._thread = threading.Thread(target=self._loop, name=f"{self.name}-io", daemon=True)
        self._thread.start()

    def _where(self) -> str:
        """Host, port and vhost (never the credentials), for error messages."""
        p = self._params
        return f"{p.host}:{p.port} (vhost {p.virtual_host!r})"

    # -- names ----------------------------------------------------------------------

    def exchange_name(self, topic: str) -> str:
        return self.exchange_template.format(topic=topic)

    def queue_name(self, topic: str, group: str) -> str:
        return self.queue_template.format(topic=topic, group=group)

    @staticmethod
    def retry_queue_name(queue: str, delay_ms: int) -> str:
        return wire.retry_queue_name(queue, delay_ms)

    @staticmethod
    def dead_letter_queue_name(queue: str) -> str:
        return wire.dead_letter_queue_name(queue)

    # -- Broker protocol ------------------------------------------------------------

    def _publish(self, topic: str, payload: bytes, key: str | None,
                 headers: Mapping[str, str]) -> str:
        """Publish to the topic's exchange and wait for the broker's confirm. Raises
        :class:`~msgpatterns.errors.UnroutableError` at once when nothing would keep the
        message (no group has subscribed to the topic yet: no exchange, or no queue
        bound); the connection and every delivery in flight are unaffected, and nothing
        is declared."""
        message_id = uuid.uuid4().hex
        props = basic_properties(message_id, codec.wire_headers(headers, key=key))
        exchange = self.exchange_name(topic)

        def op(_: Any) -> None:
            self._publish_confirmed(exchange, topic, payload, props)

        retrying = reconnecting(TRANSIENT, logger=log, what="RabbitMQ publish",
                                attempts=5, backoff=reconnect_backoff(2.0), fatal=AUTH_ERRORS)
        with self._errors("publish"):
            retrying(self._call, op)
        return message_id

    def publish_many(self, topic: str, items: Iterable[Any]) -> list[str]:
        """Publish ``items`` (bodies, or :class:`~msgpatterns.brokers.Outgoing` with key
        and headers) to the topic's exchange and wait once for all their publisher
        confirms (batched confirms: one wait, not one per message); returns the message
        ids in order, as :meth:`publish` would.

        Not atomic: the server confirms each message on its own. If any is nacked,
        returned as unroutable (no queue bound), or not confirmed within
        ``close_timeout`` seconds, :class:`~msgpatterns.brokers.PartialPublish` says
        which were confirmed (those are queued; the others may or may not be). A batch
        to an exchange that does not exist sends nothing (its ``__cause__`` is an
        :class:`~msgpatterns.errors.UnroutableError`). Never retried as a whole (that
        would duplicate the confirmed ones)."""
        self._check_open()
        batch = []
        for item in outgoing(items):
            message_id = uuid.uuid4().hex
            batch.append((message_id, body_bytes(item.body), basic_properties(
                message_id, codec.wire_headers(item.headers, key=item.key))))
        if not batch:
            return []
        exchange = self.exchange_name(topic)
        with self._errors("publish_many"):
            confirmed, failure = self._call(
                lambda _: self._publish_batch(exchange, topic, batch))
        ids = [mid if ok else None for (mid, _, _), ok in zip(batch, confirmed, strict=True)]
        if failure is None and not all(confirmed):
            failure = BrokerError(f"{self.name}: the server did not confirm every message "
                                  f"(nacked, returned as unroutable, or timed out)")
        if failure is not None:
            raise failed(topic, ids, failure) from failure
        return [mid for mid, _, _ in batch]

    def subscribe(self, topic: str, group: str) -> None:
        """Declare the topic's exchange and ``group``'s queue and binding now."""
        self._check_open()
        with self._errors("subscribe"):
            self._call(lambda _: self._declare_group(topic, group))

    def _fetch_messages(self, topics: list[str], group: str, max_messages: int,
                       timeout: float) -> list[Message]:
        """Up to ``max_messages`` deliveries of ``group``'s queues, waiting up to
        ``timeout`` seconds for the first (returns early, empty, if closed meanwhile)."""
        self._check_open()
        queues = [self.queue_name(t, group) for t in topics]
        for topic, queue in zip(topics, queues, strict=True):
            if queue not in self._routes:
                with self._errors("fetch"):
                    self._call(partial(self._start_consuming, topic=topic, group=group))
        give_up = time.monotonic() + timeout
        out: list[Message] = []
        with self._cond:
            while True:
                take_round_robin(self._buffers, queues, out, max_messages)
                left = give_up - time.monotonic()
                if out or left <= 0 or self._closed.is_set() or not self._thread.is_alive():
                    return out
                self._cond.wait(left)

    def ack(self, message: Message) -> None:
        """Ack the delivery (does not wait; a lost connection redelivers it; queued acks
        are sent by :meth:`close`)."""
        r = receipt_of(message, _Receipt, _OWNER)
        wake = False
        with self._ops_lock:  # the same admission as _submit: nothing after close
            accepted = not self._closed.is_set() and self._failure is None
            if accepted:
                self._acked.append(r)
                wake = not self._wake_pending
                self._wake_pending = True
        if not accepted:
            self._check_open()
            raise BrokerClosed(f"{self.name} is closed")
        if wake:
            self._wake()

    def nack(self, message: Message, delay: float = 0.0) -> None:
        """Redeliver after ``delay`` seconds (through a TTL retry queue, at most
        :data:`MAX_DELAY_MS`) with ``attempt + 1``, the original payload and id, and the
        current headers.

        A delay that is not a duration (negative, NaN, infinite, absurd) raises
        :class:`~msgpatterns.errors.ConfigurationError` after handing the delivery back
        to its queue: a refused settlement never leaves a delivery unacked.
        """
        r = receipt_of(message, _Receipt, _OWNER)
        try:
            checked = seconds(delay) or 0.0
            delay_bucket_ms(checked)
        except ConfigurationError:
            self._submit(lambda _: self._hand_back(r), wait=False)
            raise
        with self._errors("nack"):
            self._call(partial(self._requeue, message=message, delay=checked))

    def dead_letter(self, message: Message, record: DeadLetter) -> None:
        """Publish the record to the group's dead-letter queue, then ack. Texts are
        made encodable first; if the publish still fails, the delivery is handed back
        to its queue and the error raised."""
        r = receipt_of(message, _Receipt, _OWNER)
        with self._errors("dead_letter"):
            self._call(lambda channel: self._dead_letter_now(channel, r, record))

    def close(self) -> None:
        """Send the queued acks, hand back prefetched deliveries, cancel the consumers
        and close the connection (unacked deliveries go back to their queues).

        Idempotent. Raises :class:`~msgpatterns.errors.BrokerError` when queued work
        could not be flushed (those deliveries are redelivered by the server).
        Afterwards every operation raises :class:`~msgpatterns.errors.BrokerClosed`.
        """
        with self._ops_lock:
            if self._closed.is_set():
                return
            self._closed.set()
        self._wake()
        self._thread.join(timeout=self._close_timeout)
        with self._cond:
            self._cond.notify_all()
        if self._thread.is_alive():
            raise BrokerError(
                f"{self.name}: close() did not finish within {self._close_timeout:g}s; "
                "queued acks may be unsent (the server redelivers those deliveries)"
            )
        if self._close_error is not None:
            raise BrokerError(
                f"{self.name}: close() could not send the queued acks "
                f"({describe(self._close_error)}); the server redelivers those deliveries"
            ) from self._close_error

    # -- dead-letter admin ----------------------------------------------------------

    def dead_letter_admin(self) -> DeadLetterAdmin:
        """The admin of the groups' dead-letter queues
        (:class:`~msgpatterns.brokers.rabbitmq.admin.RabbitMQDeadLetters`; its own
        short-lived connections to this broker's server; refused once this broker is
        closed)."""
        return admin_for("msgpatterns.brokers.rabbitmq.admin:RabbitMQDeadLetters",
                         self._params, exchange=self.exchange_template,
                         queue=self.queue_template, check=self._check_open)

    # -- errors and state -----------------------------------------------------------

    def _check_open(self) -> None:
        """Raise at once if the broker is closed or its I/O thread gave up."""
        if self._failure is not None:
            raise BrokerUnavailable(str(self._failure)) from self._failure
        if self._closed.is_set():
            raise BrokerClosed(f"{self.name} is closed")

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def _errors(self, what: str) -> AbstractContextManager[None]:
        """pika's exceptions as the library's own (see :func:`pika_errors`)."""
        return pika_errors(self.name, self._where(), what, self._closed.is_set)

    def _auth_failure(self, exc: BaseException) -> BrokerUnavailable:
        user = getattr(getattr(self._params, "credentials", None), "username", "?")
        return BrokerUnavailable(
            f"RabbitMQ at {self._where()} refused user {user!r} "
            f"({type(exc).__name__}): check the user name, password and the user's "
            "permissions on the vhost"
        )

    # -- I/O-thread helpers (run with the channel) ------------------------------------

    def _hand_back(self, r: _Receipt) -> None:
        """Return the delivery to its queue (a settlement failed or was refused)."""
        if r.generation == self._generation and self._usable():
            self._channel.basic_nack(r.delivery_tag, requeue=True)
            self._acks.gone(r.delivery_tag)

    @contextmanager
    def _or_hand_back(self, r: _Receipt) -> Iterator[None]:
        """A settlement step that must not strand the delivery: on failure, hand it
        back (if the channel still lives; otherwise the server already did)."""
        try:
            yield
        except BaseException as exc:
            try:
                self._hand_back(r)
                log.warning("%s: settling delivery %d failed (%r); handed it back to %s",
                            self.name, r.delivery_tag, exc, r.queue)
            except Exception:
                log.warning("%s: handing back delivery %d failed", self.name,
                            r.delivery_tag, exc_info=True)
            raise

    def _requeue(self, channel: Any, *, message: Message, delay: float,
                 attempt: int | None = None) -> None:
        """Publish the redelivery copy (through a retry queue when delayed), confirmed,
        then ack the delivery."""
        r = receipt_of(message, _Receipt, _OWNER)
        if r.generation != self._generation:
            return  # the connection that delivered it is gone: the server redelivers it
        with self._or_hand_back(r):
            payload, fields = wire.redelivery_wire(message, r.group, attempt)
            target = r.queue
            if delay > 0:
                target = self._declare_retry_queue(r.queue, delay_bucket_ms(delay))
            self._publish_confirmed("", target, payload, pika.BasicProperties(**fields))
        self._settle(channel, r)

    def _dead_letter_now(self, channel: Any, r: _Receipt, record: DeadLetter) -> None:
        """Publish ``record`` to the group's dead-letter queue (confirmed), then ack."""
        if r.generation != self._generation:
            return
        with self._or_hand_back(r):
            payload, fields = wire.dead_letter_wire(record)
            dlq = self._declare_dead_letter_queue(r.queue)
            self._publish_confirmed("", dlq, payload, pika.BasicProperties(**fields))
        self._settle(channel, r)

    def _settle(self, channel: Any, r: _Receipt) -> None:
        """Count the delivery settled; its ack goes out with the next
        :meth:`_send_acks` (when the queued operations have run)."""
        if r.generation == self._generation:
            self._acks.ack(r.delivery_tag)

    def _send_acks(self) -> None:
        """Ack the settled deliveries: the contiguous settled prefix of the channel's
        tags with one ``basic_ack(multiple=True)`` (one quorum-queue Raft command, not
        one per message), settled tags above an unsettled one singly. A tag that is
        not settled is never covered."""
        upto, singles = self._acks.take()
        if upto is None and not singles:
            return
        channel = self._channel
        if channel is None or not channel.is_open:
            return  # the server redelivers what this channel held
        if upto is not None:
            channel.basic_ack(upto, multiple=True)
        for tag in singles:
            channel.basic_ack(tag)

    def _on_message(self, channel: Any, method: Any, properties: Any, body: bytes) -> None:
        """A delivery from the server (I/O thread). Never raises: a delivery that cannot
        become a Message is dead-lettered with the reason."""
        self._acks.delivered(method.delivery_tag)
        queue = self._tags.get(method.consumer_tag)
        if queue is None:  # a consumer we no longer track: let the server have it back
            channel.basic_nack(method.delivery_tag, requeue=True)
            self._acks.gone(method.delivery_tag)
            return
        topic, group = self._routes[queue]
        receipt = _Receipt(self._generation, method.delivery_tag, queue, group)
        try:
            check_message_size(body, properties.headers, limit=self.max_message_bytes)
            message = self._message(topic, method, properties, body,
                                    self.wire_bounds(group))
        except Exception as exc:
            log.warning("%s: delivery %d of %s is malformed (%s); dead-lettering it",
                        self.name, method.delivery_tag, queue, escape_control(describe(exc)))
            self._enqueue(partial(self._dead_letter_malformed, r=receipt, topic=topic,
                                  properties=properties, body=body, error=exc), None)
            return
        message.receipt = receipt
        with self._cond:
            buffer = self._buffers.get(queue)
            if buffer is None:
                buffer = self._buffers[queue] = deque()
            buffer.append(message)
            if len(buffer) == 1:  # a fetch waits only while its buffers are all empty
                self._cond.notify_all()

    def _dead_letter_malformed(self, channel: Any, *, r: _Receipt, topic: str,
                               properties: Any, body: bytes, error: Exception) -> None:
        try:
            headers = codec.split_transport(properties.headers or {},
                                            drop=BROKER_HEADERS).headers
        except Exception:
            headers = {}
        message = Message(body, id=optional_text(properties.message_id), topic=topic,
                          headers=headers)
        message.receipt = r
        record = DeadLetter.from_error(message, error, now=time.time(),
                                       reason=describe(error), group=r.group)
        self._dead_letter_now(channel, r, record)

    def _start_consuming(self, channel: Any, *, topic: str, group: str) -> None:
        queue = self.queue_name(topic, group)
        if queue in self._routes:
            return
        self._declare_group(topic, group)
        self._routes[queue] = (topic, group)
        self._consume(channel, queue, topic, group)

    def _consume(self, channel: Any, queue: str, topic: str, group: str) -> None:
        tag = f"{self.name}-{next(self._ids)}"
        self._tags[tag] = queue
        channel.basic_consume(queue, self._on_message, auto_ack=False, consumer_tag=tag)

    #: The decoding of a delivery (:func:`~._wire.message_of`; a test may give an
    #: instance the plain twin, :func:`~._wire.message_of_plain`).
    _message = staticmethod(wire.message_of)
    _message_plain = staticmethod(wire.message_of_plain)

    def __repr__(self) -> str:
        return f"RabbitMQBroker(name={self.name!r})"
