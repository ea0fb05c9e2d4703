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
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from msgpatterns import headers as h
from msgpatterns._callables import renamed_arguments
from msgpatterns._escape import escape_control
from msgpatterns._extras import require
from msgpatterns.brokers import _codec as codec
from msgpatterns.brokers._ack_window import AckWindow
from msgpatterns.brokers._adapter import BrokerAdapter
from msgpatterns.brokers._amqp_tls import pika_url
from msgpatterns.brokers._batch import failed, outgoing
from msgpatterns.brokers._reconnect import (
    RECONNECT_BACKOFF,
    reconnect_backoff,
    reconnecting,
)
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.delivery import receipt_of
from msgpatterns.errors import (
    BrokerClosed,
    BrokerError,
    BrokerUnavailable,
    ConfigurationError,
    MalformedMessage,
    UnroutableError,
    describe,
    printable,
    seconds,
)
from msgpatterns.limits import (
    DEFAULT_MAX_MESSAGE_BYTES,
    check_max_message_bytes,
    check_message_size,
)
from msgpatterns.message import Message

pika = require("pika", "rabbitmq")

if TYPE_CHECKING:
    from msgpatterns.brokers.admin.rabbitmq import RabbitMQDeadLetters

__all__ = ["MAX_DELAY_MS", "RabbitMQBroker", "delay_bucket_ms"]

#: Named in the error for a message this adapter did not deliver.
_OWNER = "a RabbitMQBroker"

log = logging.getLogger("msgpatterns.brokers.rabbitmq")

T = TypeVar("T")

#: Errors the reconnect loop treats as a lost connection (retried with backoff).
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    pika.exceptions.AMQPConnectionError,
    pika.exceptions.AMQPChannelError,
    pika.exceptions.ConnectionWrongStateError,
    ConnectionError,
)
#: Errors that mean an operation met a dying connection (worth one more try after the
#: reconnect). A refusal by the server (404, 406, returned, nacked) is not one of them.
_TRANSIENT: tuple[type[BaseException], ...] = (
    pika.exceptions.AMQPConnectionError,
    pika.exceptions.ChannelWrongStateError,
    ConnectionError,
)
#: Never retried: a wrong user, password or vhost permission does not heal by itself.
_AUTH_ERRORS: tuple[type[BaseException], ...] = (
    pika.exceptions.ProbableAuthenticationError,
    pika.exceptions.AuthenticationError,
    pika.exceptions.ProbableAccessDeniedError,
)
# Headers RabbitMQ adds that handlers have no use for.
_BROKER_HEADERS = ("x-death", "x-delivery-count", "x-first-death-exchange",
                   "x-first-death-queue", "x-first-death-reason", "x-last-death-exchange",
                   "x-last-death-queue", "x-last-death-reason")
_DELIVERY_COUNT = "x-delivery-count"
#: Deliveries whose headers are only these (or none) carry no library header: their
#: Message is built without splitting the transport headers (same result, less work).
_ONLY_BROKER_HEADERS = frozenset(_BROKER_HEADERS)
#: The longest retry delay a retry queue holds (RabbitMQ's TTL and ``x-expires`` are at
#: most 2^32-1 ms; this bucket plus the queue's one-minute expiry margin stays below).
MAX_DELAY_MS = 4_200_000_000
_SHORTSTR = 255  # AMQP short strings (header names, message ids): at most 255 bytes


def delay_bucket_ms(delay: float) -> int:
    """``delay`` in milliseconds rounded *up* to two significant digits (at least 1):
    a retry is never early, at most ~10% late, and delays share few retry queues.

    Delays above :data:`MAX_DELAY_MS` (about 48.6 days, RabbitMQ's TTL limit) get that
    bucket. A negative, NaN or infinite delay raises
    :class:`~msgpatterns.errors.ConfigurationError`.
    """
    if isinstance(delay, bool) or not isinstance(delay, int | float) or not (
        math.isfinite(delay) and delay >= 0
    ):
        raise ConfigurationError(f"a retry delay must be finite and >= 0 seconds: {delay!r}")
    if delay * 1000 >= MAX_DELAY_MS:
        return MAX_DELAY_MS
    ms = max(1, math.ceil(delay * 1000))
    if ms < 100:
        return ms
    step = int(10 ** (len(str(ms)) - 2))
    return min(MAX_DELAY_MS, -(-ms // step) * step)


def _shortstr(value: str) -> str:
    """``value`` as an encodable AMQP short string (escaped, at most 255 bytes)."""
    data = printable(value).encode("utf-8")
    if len(data) <= _SHORTSTR:
        return printable(value)
    return data[:_SHORTSTR].decode("utf-8", errors="ignore")


def _wire_text(value: Any) -> Any:
    return printable(value) if isinstance(value, str) else value


def _optional_text(value: Any) -> str | None:
    """A property from the wire (str, or bytes that were not UTF-8) as text, or None."""
    if value is None:
        return None
    text = codec.text(value)
    return text or None


def _delivery_count(value: Any, redelivered: bool) -> int:
    """The server's count of earlier deliveries of this copy, validated."""
    if value is None:
        return 1 if redelivered else 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise MalformedMessage(
            f"header {_DELIVERY_COUNT!r} must be a non-negative integer, got {value!r}"
        )
    return value


def _attempt(headers: Mapping[str, str], redeliveries: int) -> int:
    """The durable attempt number; library headers that are out of range (an attempt
    that is not an integer in range, a time that is not a finite number) are refused:
    the message is dead-lettered with the reason (see
    :func:`msgpatterns.headers.header_problem`)."""
    problem = h.header_problem(headers)
    if problem is not None:
        raise MalformedMessage(problem)
    return codec.attempt_of(headers, redeliveries)


def take_round_robin(buffers: Mapping[str, deque[Message]], queues: Sequence[str],
                     out: list[Message], limit: int) -> None:
    """Move buffered deliveries into ``out``, one per queue in turn, until ``out`` holds
    ``limit`` or every buffer is empty (so no queue starves the others)."""
    taking = True
    while taking and len(out) < limit:
        taking = False
        for queue in queues:
            buffer = buffers.get(queue)
            if buffer and len(out) < limit:
                out.append(buffer.popleft())
                taking = True


def retry_queue_arguments(queue: str, delay_ms: int, queue_type: str | None) -> dict[str, Any]:
    """The arguments of retry queue ``<queue>.retry.<delay_ms>``: that message TTL, then
    dead-lettered back to ``queue``; deleted a minute after its last use."""
    args: dict[str, Any] = {
        **({} if queue_type is None else {"x-queue-type": queue_type}),
        "x-message-ttl": delay_ms,
        "x-dead-letter-exchange": "",
        "x-dead-letter-routing-key": queue,
        "x-expires": delay_ms + 60_000,
    }
    if queue_type == "quorum":  # at-least-once dead-lettering back to the queue
        args.update({"x-dead-letter-strategy": "at-least-once",
                     "x-overflow": "reject-publish"})
    return args


def dead_letter_queue_arguments(queue_type: str | None) -> dict[str, Any]:
    """A classic queue: dead letters are inspected by fetching and returning them,
    which a quorum queue's delivery limit would eventually punish."""
    return {} if queue_type is None else {"x-queue-type": "classic"}


def redelivery_wire(message: Message, group: str, attempt: int | None = None
                    ) -> tuple[bytes, Any]:
    """Payload and properties of the copy that redelivers ``message`` to ``group``."""
    wire = codec.redelivery_headers(message, group=group, with_id=False, attempt=attempt)
    return body_bytes(message.raw_body), RabbitMQBroker._properties(message.id, wire)


def dead_letter_wire(record: DeadLetter) -> tuple[bytes, Any]:
    """Payload and properties of the dead letter holding ``record``."""
    wire = codec.dead_letter_headers(record, with_id=False)
    return (codec.dead_letter_body(record),
            RabbitMQBroker._properties(record.message.id, wire))


def publish_confirmed(side: Any, exchange: str, routing_key: str, payload: bytes,
                      props: Any, *, who: str) -> None:
    """Publish (mandatory) on ``side``, a channel in confirm mode, and wait for the
    confirm; a message nothing would keep raises UnroutableError."""
    try:
        side.basic_publish(exchange, routing_key, payload, props, mandatory=True)
    except pika.exceptions.UnroutableError as exc:
        raise UnroutableError(
            f"{who}: no queue is bound to exchange {exchange!r} for routing key "
            f"{routing_key!r} (has a group subscribed?); nothing was sent"
        ) from exc
    except pika.exceptions.ChannelClosedByBroker as exc:
        if exc.reply_code == 404:
            raise UnroutableError(
                f"{who}: exchange {exchange!r} does not exist (no group has "
                f"subscribed to it yet); nothing was sent"
            ) from exc
        raise


def coalesce_output(conn: Any) -> None:
    """Join the frames pika buffered for ``conn`` into one chunk, so that they leave in
    as few ``send`` calls as the socket takes (pika sends one frame per call: three per
    message). The bytes, their order and pika's byte count are unchanged; with a pika
    whose transport does not look as expected this does nothing."""
    transport = getattr(getattr(conn, "_impl", None), "_transport", None)
    buffers = getattr(transport, "_tx_buffers", None)
    if isinstance(buffers, deque) and len(buffers) > 1:
        joined = b"".join(buffers)
        buffers.clear()
        buffers.append(joined)


def url_parameters(url: Any, connect_timeout: float | None = None) -> Any:
    """pika connection parameters for an ``amqp://`` URL (``pika.ConnectionParameters``
    pass through); with ``connect_timeout``, a URL without timeouts gets it as its
    socket and stack timeouts (pika's defaults are 10 s and 15 s)."""
    if not isinstance(url, str):
        if not isinstance(url, pika.connection.Parameters):
            raise ConfigurationError(
                f"expected an amqp:// URL or pika.ConnectionParameters, got {url!r}")
        return url
    try:
        params = pika.URLParameters(pika_url(url))  # cafile= etc. as with aio-pika
    except ConfigurationError:
        raise
    except Exception as exc:
        raise ConfigurationError(f"not a usable AMQP URL: {describe(exc)}") from exc
    if connect_timeout is not None:
        query = url.partition("?")[2]
        if "socket_timeout" not in query:
            params.socket_timeout = connect_timeout
        if "stack_timeout" not in query:
            params.stack_timeout = connect_timeout
    return params


@contextmanager
def pika_errors(name: str, where: str, what: str,
                closed: Callable[[], bool] = lambda: False) -> Iterator[None]:
    """Translate pika's and the socket's exceptions into the library's own (the
    original is the cause); the library's own errors pass unchanged. ``name`` says
    who failed, ``where`` the server (never the credentials), ``closed`` whether a
    lost connection is the owner's own close."""
    try:
        yield
    except (BrokerError, ConfigurationError):
        raise
    except pika.exceptions.UnroutableError as exc:
        raise UnroutableError(f"{name}: {what}: RabbitMQ returned the message "
                              "(no queue bound); nothing was sent") from exc
    except pika.exceptions.NackError as exc:
        raise BrokerError(f"{name}: {what}: RabbitMQ refused the message "
                          "(publisher nack)") from exc
    except (pika.exceptions.AMQPConnectionError, ConnectionError) as exc:
        if closed():
            raise BrokerClosed(f"{name} is closed") from exc
        raise BrokerUnavailable(f"{name}: {what}: connection to {where} "
                                f"failed: {describe(exc) or type(exc).__name__}") from exc
    except pika.exceptions.AMQPError as exc:
        raise BrokerError(f"{name}: {what} failed: "
                          f"{describe(exc) or type(exc).__name__}") from exc


class _Confirms:
    """A channel in confirm mode whose confirms are counted as they arrive instead of
    awaited one publish at a time (pika's BlockingChannel waits for each)."""

    def __init__(self, channel: Any) -> None:
        self.channel = channel
        self.seq = 0  # the last delivery tag published on the channel
        self.pending: dict[int, None] = {}  # tags awaiting a confirm, in order
        self.outcome: dict[int, bool] = {}  # tag -> acked (True) or nacked (False)
        self.returned: set[str] = set()  # message ids the server returned (unroutable)
        self.ready = False
        self.closed_by: BaseException | None = None  # why the server closed the channel

    def on_close(self, channel: Any, reason: BaseException) -> None:
        self.closed_by = reason

    def on_select_ok(self, frame: Any) -> None:
        self.ready = True

    def on_confirm(self, frame: Any) -> None:
        method = frame.method
        acked = isinstance(method, pika.spec.Basic.Ack)
        if method.multiple:
            done = list(itertools.takewhile(lambda t: t <= method.delivery_tag,
                                            self.pending))
        else:
            done = [method.delivery_tag]
        for tag in done:
            if self.pending.pop(tag, "gone") is None:
                self.outcome[tag] = acked

    def on_return(self, channel: Any, method: Any, properties: Any, body: bytes) -> None:
        if properties.message_id:
            self.returned.add(properties.message_id)


class _Receipt(NamedTuple):
    """Which delivery of which connection (a tuple: built once per delivery on the
    I/O thread, so it is cheap to make)."""

    generation: int
    delivery_tag: int
    queue: str
    group: str


class RabbitMQBroker(BrokerAdapter):
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
        self._batches: _Confirms | None = None  # publish_many: confirms counted, not awaited
        self._generation = 0
        self._acks = AckWindow()  # the consume channel's settled tags (I/O thread only)
        self._ids = itertools.count(1)
        retrying = reconnecting(_CONNECTION_ERRORS, logger=log, what="RabbitMQ connect",
                                attempts=None, within=connect_timeout,
                                backoff=reconnect_backoff(1.0), fatal=_AUTH_ERRORS)
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
        return f"{queue}.retry.{delay_ms}"

    @staticmethod
    def dead_letter_queue_name(queue: str) -> str:
        return f"{queue}.dlq"

    # -- Broker protocol ------------------------------------------------------------

    def _publish(self, topic: str, payload: bytes, key: str | None,
                 headers: Mapping[str, str]) -> str:
        """Publish to the topic's exchange and wait for the broker's confirm. Raises
        :class:`~msgpatterns.errors.UnroutableError` at once when nothing would keep the
        message (no group has subscribed to the topic yet: no exchange, or no queue
        bound); the connection and every delivery in flight are unaffected, and nothing
        is declared."""
        message_id = uuid.uuid4().hex
        props = self._properties(message_id, codec.wire_headers(headers, key=key))
        exchange = self.exchange_name(topic)

        def op(_: Any) -> None:
            self._publish_confirmed(exchange, topic, payload, props)

        retrying = reconnecting(_TRANSIENT, logger=log, what="RabbitMQ publish",
                                attempts=5, backoff=reconnect_backoff(2.0), fatal=_AUTH_ERRORS)
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
            batch.append((message_id, body_bytes(item.body), self._properties(
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

    def dead_letter_admin(self) -> RabbitMQDeadLetters:
        """The admin of the groups' dead-letter queues (its own short-lived
        connections to this broker's server; refused once this broker is closed)."""
        from msgpatterns.brokers.admin.rabbitmq import RabbitMQDeadLetters

        return RabbitMQDeadLetters(self._params, exchange=self.exchange_template,
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

    # -- the I/O thread -----------------------------------------------------------

    def _loop(self) -> None:
        forever = reconnecting(_CONNECTION_ERRORS, logger=log, what="RabbitMQ reconnect",
                               attempts=None, backoff=RECONNECT_BACKOFF, until=self._closed,
                               fatal=_AUTH_ERRORS)
        try:
            while not self._closed.is_set():
                try:
                    if self._conn is None:
                        forever(self._reconnect)
                        continue
                    self._run_ops()
                    self._conn.process_data_events(time_limit=1.0)
                    if not self._usable():
                        raise pika.exceptions.ChannelWrongStateError(
                            "the consume channel was closed")
                except BrokerError as exc:  # authentication: give up, never retry
                    self._failure = exc
                    log.error("%s: %s", self.name, exc)
                    break
                except Exception as exc:
                    if self._closed.is_set():
                        break
                    log.warning("%s: connection lost (%r); reconnecting", self.name, exc)
                    self._lost()
        finally:
            self._shutdown()

    def _usable(self) -> bool:
        conn, channel = self._conn, self._channel
        return bool(conn is not None and conn.is_open and channel is not None
                    and channel.is_open)

    def _connect(self, retrying: Any) -> None:
        def connect() -> None:
            try:
                conn = pika.BlockingConnection(self._params)
            except _AUTH_ERRORS as exc:
                raise self._auth_failure(exc) from exc
            channel = conn.channel()
            channel.basic_qos(prefetch_count=self.prefetch)
            self._conn, self._channel, self._side = conn, channel, None
            self._generation += 1
            self._acks = AckWindow()  # delivery tags are per channel

        retrying(connect)

    def _reconnect(self) -> None:
        if self._closed.is_set():
            return
        self._connect(lambda fn: fn())
        for queue, (topic, group) in list(self._routes.items()):
            self._consume(self._channel, queue, topic, group)
        log.info("%s: reconnected", self.name)

    def _lost(self) -> None:
        conn, self._conn, self._channel, self._side = self._conn, None, None, None
        self._tags.clear()  # consumer tags die with their channel
        with self._cond:
            for buffer in self._buffers.values():
                buffer.clear()  # their deliveries died with the connection
        if conn is not None:
            try:
                conn.close()
            except Exception:
                log.debug("closing the lost connection failed", exc_info=True)

    def _shutdown(self) -> None:
        """Flush, hand back, cancel and close; then fail whatever still waits."""
        try:
            if self._usable():
                self._flush_and_hand_back()
            if self._conn is not None:
                try:
                    self._conn.close()
                except Exception:
                    log.debug("%s: closing the connection failed", self.name, exc_info=True)
        finally:
            self._conn = self._channel = self._side = None
            self._fail_waiting()
            with self._cond:
                for buffer in self._buffers.values():
                    buffer.clear()
                self._cond.notify_all()

    def _flush_and_hand_back(self) -> None:
        try:
            self._run_ops()
            # Deliveries received but not yet dispatched would be nacked by pika's
            # cancel (a quorum queue counts that as an attempt): buffer them first, so
            # they are handed back below with their own attempt number.
            self._conn.process_data_events(time_limit=0)
            for tag in list(self._tags):
                self._channel.basic_cancel(tag)
            self._tags.clear()
            with self._cond:
                unused = [m for buffer in self._buffers.values() for m in buffer]
                for buffer in self._buffers.values():
                    buffer.clear()
            for message in unused:  # prefetched, never handed out: not an attempt
                self._requeue(self._channel, message=message, delay=0.0,
                              attempt=message.attempt)
            self._run_ops()
        except Exception as exc:
            self._close_error = exc
            log.error("%s: closing could not flush queued acks (%r); the server "
                      "redelivers those deliveries", self.name, exc)

    def _fail_waiting(self) -> None:
        """After the I/O thread's last turn: nothing queued will ever run."""
        error: BrokerError = (BrokerUnavailable(str(self._failure))
                              if self._failure is not None
                              else BrokerClosed(f"{self.name} is closed"))
        with self._ops_lock:
            waiting, self._ops = list(self._ops), deque()
            unsent, self._acked = len(self._acked), []
            self._wake_pending = False
        for _, future in waiting:
            if future is None:
                unsent += 1
            elif future.set_running_or_notify_cancel():
                future.set_exception(error)
        if unsent:
            log.warning("%s: %d queued ack(s) were not sent (the connection was gone); "
                        "the server redelivers those deliveries", self.name, unsent)

    def _enqueue(self, fn: Callable[[Any], Any], future: Future[Any] | None) -> None:
        with self._ops_lock:
            self._ops.append((fn, future))
            wake = not self._wake_pending
            self._wake_pending = True
        if wake:
            self._wake()

    def _submit(self, fn: Callable[[Any], T], *, wait: bool) -> Future[T] | None:
        """Queue ``fn(channel)`` for the I/O thread; raises BrokerClosed after close()
        (checked under the queue's lock: whatever was queued before close is flushed)."""
        future: Future[T] | None = Future() if wait else None
        wake = accepted = False
        with self._ops_lock:
            if not self._closed.is_set() and self._failure is None:
                accepted = True
                self._ops.append((fn, future))
                wake = not self._wake_pending
                self._wake_pending = True
        if not accepted:
            self._check_open()
            raise BrokerClosed(f"{self.name} is closed")
        if wake:
            self._wake()
        return future

    def _call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(channel)`` on the I/O thread and return its result."""
        if threading.current_thread() is self._thread:
            return fn(self._channel)
        future = self._submit(fn, wait=True)
        assert future is not None
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                if not self._thread.is_alive():
                    self._check_open()
                    raise BrokerClosed(f"{self.name}: the I/O thread has stopped") from None

    def _wake(self) -> None:
        conn = self._conn
        if conn is None:
            return  # the loop runs the queue once reconnected
        try:
            conn.add_callback_threadsafe(self._noop)
        except Exception:
            log.debug("wake-up failed; the loop will pick the work up", exc_info=True)

    @staticmethod
    def _noop() -> None:
        pass

    def _run_ops(self) -> None:
        """Run the queued operations. An operation's failure goes to its caller; only a
        dead connection or consume channel stops the run (and triggers a reconnect).
        Acks handed over by :meth:`ack` are counted first, all at once (acks of
        distinct deliveries commute with every other operation)."""
        while True:
            with self._ops_lock:
                acked, self._acked = self._acked, []
                if not acked and not self._ops:
                    self._wake_pending = False
                    break
                op = self._ops.popleft() if self._ops else None
            for r in acked:
                self._settle(None, r)
            if op is None:
                continue
            fn, future = op
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(self._channel)
            except BaseException as exc:
                if future is not None:
                    future.set_exception(exc)
                else:
                    log.warning("%s: background operation failed: %r", self.name, exc)
                if not self._usable():
                    raise
            else:
                if future is not None:
                    future.set_result(result)
        self._send_acks()

    # -- I/O-thread helpers (run with the channel) ------------------------------------

    def _side_channel(self) -> Any:
        """The channel for publishes and declarations, (re)opened on demand: the server
        closes it on a refused publish or declaration, never the consume channel."""
        side = self._side
        if side is None or not side.is_open:
            if self._conn is None:
                raise pika.exceptions.ConnectionWrongStateError("not connected")
            side = self._conn.channel()
            side.confirm_delivery()
            self._side = side
        return side

    def _publish_confirmed(self, exchange: str, routing_key: str, payload: bytes,
                           props: Any) -> None:
        """Publish (mandatory) on the side channel and wait for the confirm; a message
        nothing would keep raises UnroutableError."""
        publish_confirmed(self._side_channel(), exchange, routing_key, payload, props,
                          who=self.name)

    def _confirm_channel(self) -> _Confirms:
        """The publish_many channel, (re)opened in confirm mode with counted confirms."""
        batches = self._batches
        if batches is not None and batches.channel.is_open:
            return batches
        if self._conn is None:
            raise pika.exceptions.ConnectionWrongStateError("not connected")
        batches = _Confirms(self._conn.channel())
        impl = batches.channel._impl
        impl.confirm_delivery(ack_nack_callback=batches.on_confirm,
                              callback=batches.on_select_ok)
        impl.add_on_return_callback(batches.on_return)
        impl.add_on_close_callback(batches.on_close)
        give_up = time.monotonic() + self._close_timeout
        while not batches.ready and time.monotonic() < give_up:
            self._conn.process_data_events(time_limit=0.002)
        if not batches.ready:
            raise pika.exceptions.AMQPChannelError("confirm mode was not acknowledged")
        self._batches = batches
        return batches

    def _publish_batch(self, exchange: str, routing_key: str,
                       batch: Sequence[tuple[str, bytes, Any]]
                       ) -> tuple[list[bool], BaseException | None]:
        """Publish every message (mandatory), then serve the connection until each is
        confirmed or ``close_timeout`` passes: which were acked (and not returned), and
        the failure that stopped the batch, if any."""
        confirms = self._confirm_channel()
        tags: list[int] = []
        failure: BaseException | None = None
        impl = confirms.channel._impl  # buffered writes: no flush per message
        try:
            for _, payload, props in batch:
                # counted before the publish: its confirm can arrive while pika flushes
                confirms.seq += 1
                confirms.pending[confirms.seq] = None
                tags.append(confirms.seq)
                impl.basic_publish(exchange, routing_key, payload, props, mandatory=True)
            coalesce_output(self._conn)
            give_up = time.monotonic() + self._close_timeout
            while (confirms.pending and confirms.channel.is_open
                   and time.monotonic() < give_up):
                assert self._conn is not None
                self._conn.process_data_events(time_limit=0.002)
        except pika.exceptions.AMQPChannelError as exc:  # closed by the server meanwhile
            failure = confirms.closed_by or exc
        if failure is None and confirms.pending and not confirms.channel.is_open:
            failure = confirms.closed_by or BrokerError(
                f"{self.name}: the publish channel closed before every message was "
                "confirmed")
        if isinstance(failure, pika.exceptions.ChannelClosedByBroker) \
                and failure.reply_code == 404:
            failure = UnroutableError(f"{self.name}: exchange {exchange!r} does not exist "
                                      "(no group has subscribed to it yet)")
        ok = [confirms.outcome.pop(tag, False) and mid not in confirms.returned
              for tag, (mid, _, _) in zip(tags, batch, strict=False)]
        ok += [False] * (len(batch) - len(ok))
        confirms.returned.clear()
        for tag in tags:
            confirms.pending.pop(tag, None)
        if failure is not None:
            self._batches = None
        return ok, failure

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
            payload, props = redelivery_wire(message, r.group, attempt)
            target = r.queue
            if delay > 0:
                target = self._declare_retry_queue(r.queue, delay_bucket_ms(delay))
            self._publish_confirmed("", target, payload, props)
        self._settle(channel, r)

    def _dead_letter_now(self, channel: Any, r: _Receipt, record: DeadLetter) -> None:
        """Publish ``record`` to the group's dead-letter queue (confirmed), then ack."""
        if r.generation != self._generation:
            return
        with self._or_hand_back(r):
            payload, props = dead_letter_wire(record)
            dlq = self._declare_dead_letter_queue(r.queue)
            self._publish_confirmed("", dlq, payload, props)
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
            message = self._message(topic, method, properties, body)
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

    @staticmethod
    def _message(topic: str, method: Any, properties: Any, body: bytes) -> Message:
        """The Message of a delivery; raises MalformedMessage naming a bad header.

        A delivery with no headers but the server's (most of them) skips the transport
        split: it carries no library header to read or check. Same result as
        :meth:`_message_plain` (tests/test_rabbitmq_fast_paths.py checks it on
        generated deliveries)."""
        raw = properties.headers
        if not raw:
            redeliveries = 1 if method.redelivered else 0
        elif type(raw) is dict and raw.keys() <= _ONLY_BROKER_HEADERS:
            redeliveries = _delivery_count(raw.get(_DELIVERY_COUNT), bool(method.redelivered))
        else:
            return RabbitMQBroker._message_plain(topic, method, properties, body)
        timestamp = properties.timestamp
        return Message(
            body,
            id=_optional_text(properties.message_id),
            topic=topic,
            timestamp=float(timestamp) if isinstance(timestamp, int) else None,
            attempt=1 + redeliveries,
        )

    @staticmethod
    def _message_plain(topic: str, method: Any, properties: Any, body: bytes) -> Message:
        """The Message of a delivery, every header split and checked (the plain twin of
        :meth:`_message`)."""
        raw = properties.headers or {}
        if not isinstance(raw, Mapping):
            raise MalformedMessage(f"headers are not a table: {type(raw).__name__}")
        redeliveries = _delivery_count(raw.get(_DELIVERY_COUNT), bool(method.redelivered))
        t = codec.split_transport(raw, drop=_BROKER_HEADERS)
        timestamp = t.timestamp
        if timestamp is None and isinstance(properties.timestamp, int):
            timestamp = float(properties.timestamp)
        return Message(
            body,
            id=t.id or _optional_text(properties.message_id),
            key=t.key,
            topic=topic,
            headers=t.headers,
            timestamp=timestamp,
            attempt=_attempt(t.headers, redeliveries),
        )

    def _dead_letter_malformed(self, channel: Any, *, r: _Receipt, topic: str,
                               properties: Any, body: bytes, error: Exception) -> None:
        try:
            headers = codec.split_transport(properties.headers or {},
                                            drop=_BROKER_HEADERS).headers
        except Exception:
            headers = {}
        message = Message(body, id=_optional_text(properties.message_id), topic=topic,
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

    def _declare_group(self, topic: str, group: str) -> None:
        exchange = self._declare_exchange(self.exchange_name(topic))
        queue = self._declare_queue(self.queue_name(topic, group))
        if self.declare and f"bind:{queue}" not in self._declared:
            self._side_channel().queue_bind(queue, exchange, routing_key=topic)
            self._declared.add(f"bind:{queue}")

    def _declare_exchange(self, exchange: str) -> str:
        if self.declare and f"exchange:{exchange}" not in self._declared:
            self._side_channel().exchange_declare(exchange, exchange_type="fanout",
                                                  durable=True)
            self._declared.add(f"exchange:{exchange}")
        return exchange

    def _queue_arguments(self) -> dict[str, Any]:
        return {} if self.queue_type is None else {"x-queue-type": self.queue_type}

    def _declare_queue(self, queue: str) -> str:
        if self.declare and f"queue:{queue}" not in self._declared:
            self._side_channel().queue_declare(queue, durable=True,
                                               arguments=self._queue_arguments())
            self._declared.add(f"queue:{queue}")
        return queue

    def _declare_dead_letter_queue(self, queue: str) -> str:
        """A classic queue: dead letters are inspected by fetching and returning them,
        which a quorum queue's delivery limit would eventually punish."""
        name = self.dead_letter_queue_name(queue)
        if self.declare and f"queue:{name}" not in self._declared:
            self._side_channel().queue_declare(
                name, durable=True, arguments=dead_letter_queue_arguments(self.queue_type))
            self._declared.add(f"queue:{name}")
        return name

    def _declare_retry_queue(self, queue: str, delay_ms: int) -> str:
        """Declared on every use: ``x-expires`` deletes a retry queue a minute after its
        last use, always after its last message has moved on."""
        name = self.retry_queue_name(queue, delay_ms)
        self._side_channel().queue_declare(
            name, durable=True,
            arguments=retry_queue_arguments(queue, delay_ms, self.queue_type))
        return name

    @staticmethod
    def _properties(message_id: str | None, headers: Mapping[str, str]) -> Any:
        """Message properties with every text made encodable (lone surrogates escaped,
        short strings cut to 255 bytes): pika can always encode them."""
        return pika.BasicProperties(
            message_id=None if message_id is None else _shortstr(message_id),
            headers={_shortstr(str(k)): _wire_text(v) for k, v in headers.items()},
            delivery_mode=2,
            timestamp=int(time.time()),
        )


    def __repr__(self) -> str:
        return f"RabbitMQBroker(name={self.name!r})"
