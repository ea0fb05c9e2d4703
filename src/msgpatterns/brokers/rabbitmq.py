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
  Consumer's ``max_in_flight``).
* A retry or dead letter is published with publisher confirms *before* the original is
  acked: a crash in between duplicates it, never loses it.
* The attempt number is durable: the attempt header written on every retry, plus the
  quorum queue's ``x-delivery-count`` for deliveries that died with their consumer.
  (Classic queues only say "redelivered": such a redelivery counts as one attempt.)
* Thread-safe: pika connections are not, so one I/O thread owns the connection and
  every other thread hands it work (``add_callback_threadsafe``). ``ack`` does not
  wait; ``nack``, ``dead_letter`` and ``publish`` return once the broker confirmed.
* A lost connection is re-established (tenacity, until :meth:`close`). Deliveries of
  the lost connection go back to their queue on the server; their late acks and nacks
  are dropped, so they are redelivered (at least once) rather than settled twice.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from msgpatterns._extras import require
from msgpatterns.brokers import _codec as codec
from msgpatterns.brokers._dlq import selected
from msgpatterns.brokers._reconnect import reconnecting
from msgpatterns.deadletter import DeadLetter, body_bytes
from msgpatterns.message import Message

pika = require("pika", "rabbitmq")

__all__ = ["RabbitMQBroker", "delay_bucket_ms"]

log = logging.getLogger("msgpatterns.brokers.rabbitmq")

T = TypeVar("T")

_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    pika.exceptions.AMQPConnectionError,
    pika.exceptions.AMQPChannelError,
    pika.exceptions.ConnectionWrongStateError,
    ConnectionError,
)
# Headers RabbitMQ adds that handlers have no use for.
_BROKER_HEADERS = ("x-death", "x-delivery-count", "x-first-death-exchange",
                   "x-first-death-queue", "x-first-death-reason", "x-last-death-exchange",
                   "x-last-death-queue", "x-last-death-reason")


def delay_bucket_ms(delay: float) -> int:
    """``delay`` in milliseconds rounded *up* to two significant digits (at least 1):
    a retry is never early, at most ~10% late, and delays share few retry queues."""
    ms = max(1, math.ceil(delay * 1000))
    if ms < 100:
        return ms
    step = int(10 ** (len(str(ms)) - 2))
    return -(-ms // step) * step


@dataclass(frozen=True, slots=True)
class _Receipt:
    generation: int
    delivery_tag: int
    queue: str
    group: str


class RabbitMQBroker:
    """The :class:`~msgpatterns.brokers.base.Broker` protocol on RabbitMQ.

    Args:
        url_or_parameters: an ``amqp://`` URL or ``pika.ConnectionParameters``. (The
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
        connect_timeout: seconds the constructor tries to connect before raising.
    """

    def __init__(
        self,
        url_or_parameters: Any,
        *,
        prefetch: int = 100,
        exchange: str = "{topic}",
        queue: str = "{topic}.{group}",
        queue_type: str | None = "quorum",
        declare: bool = True,
        name: str | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        if prefetch < 1:
            raise ValueError("prefetch must be at least 1")
        if isinstance(url_or_parameters, str):
            params = pika.URLParameters(url_or_parameters)
        else:
            params = url_or_parameters
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
        self._ops: deque[tuple[Callable[[Any], Any], Future[Any] | None]] = deque()
        self._ops_lock = threading.Lock()
        self._wake_pending = False
        self._cond = threading.Condition(threading.Lock())
        self._buffers: dict[str, deque[Message]] = {}
        self._routes: dict[str, tuple[str, str]] = {}  # queue -> (topic, group)
        self._tags: dict[str, str] = {}  # consumer tag -> queue
        self._declared: set[str] = set()
        self._conn: Any = None
        self._channel: Any = None
        self._generation = 0
        self._ids = itertools.count(1)
        self._connect(reconnecting(_CONNECTION_ERRORS, logger=log, what="RabbitMQ connect",
                                   attempts=max(1, int(connect_timeout / 1.5)), max_wait=2.0))
        self._thread = threading.Thread(target=self._loop, name=f"{self.name}-io", daemon=True)
        self._thread.start()

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

    def now(self) -> float:
        return time.time()

    def publish(
        self,
        topic: str,
        body: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> str:
        """Publish to the topic's exchange and wait for the broker's confirm; returns
        the message id. Raises ``pika.exceptions.UnroutableError`` when no queue is
        bound (no group has subscribed yet): nothing would keep the message."""
        message_id = uuid.uuid4().hex
        payload = body_bytes(body)
        wire = codec.wire_headers(headers, key=key)
        exchange = self.exchange_name(topic)

        def op(channel: Any) -> None:
            self._declare_exchange(channel, exchange)
            channel.basic_publish(exchange, topic, payload,
                                  self._properties(message_id, wire), mandatory=True)

        retrying = reconnecting(_CONNECTION_ERRORS, logger=log, what="RabbitMQ publish",
                                attempts=5, max_wait=2.0)
        retrying(self._call, op)
        return message_id

    def subscribe(self, topic: str, group: str) -> None:
        """Declare the topic's exchange and ``group``'s queue and binding now."""
        self._call(lambda channel: self._declare_group(channel, topic, group))

    def fetch(
        self,
        topics: Sequence[str],
        group: str,
        max_messages: int = 1,
        timeout: float = 0.0,
    ) -> list[Message]:
        """Up to ``max_messages`` deliveries of ``group``'s queues, waiting up to
        ``timeout`` seconds for the first."""
        if isinstance(topics, str):
            topics = [topics]
        queues = [self.queue_name(t, group) for t in topics]
        for topic, queue in zip(topics, queues, strict=True):
            if queue not in self._routes:
                self._call(partial(self._start_consuming, topic=topic, group=group))
        give_up = time.monotonic() + timeout
        out: list[Message] = []
        with self._cond:
            while True:
                taking = True
                while taking and len(out) < max_messages:  # round robin over the queues
                    taking = False
                    for queue in queues:
                        buffer = self._buffers.get(queue)
                        if buffer and len(out) < max_messages:
                            out.append(buffer.popleft())
                            taking = True
                left = give_up - time.monotonic()
                if out or left <= 0 or self._closed.is_set():
                    return out
                self._cond.wait(left)

    def ack(self, message: Message) -> None:
        """Ack the delivery (does not wait; a lost connection redelivers it)."""
        r = self._receipt(message)
        self._submit(lambda channel: self._settle(channel, r), wait=False)

    def nack(self, message: Message, delay: float = 0.0) -> None:
        """Redeliver after ``delay`` seconds (through a TTL retry queue) with
        ``attempt + 1``, the original payload and the current headers."""
        self._call(partial(self._requeue, message=message, delay=delay))

    def dead_letter(self, message: Message, record: DeadLetter) -> None:
        """Publish the record to the group's dead-letter queue, then ack."""
        r = self._receipt(message)
        payload = codec.dead_letter_body(record)
        wire = codec.dead_letter_headers(record)
        wire.pop(codec.MESSAGE_ID, None)

        def op(channel: Any) -> None:
            if r.generation != self._generation:
                return
            dlq = self._declare_dead_letter_queue(channel, r.queue)
            channel.basic_publish("", dlq, payload, self._properties(message.id, wire),
                                  mandatory=True)
            self._settle(channel, r)

        self._call(op)

    def close(self) -> None:
        """Flush pending acks and close the connection (unacked deliveries go back to
        their queues)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake()
        self._thread.join(timeout=10)
        with self._cond:
            self._cond.notify_all()

    # -- dead-letter admin ----------------------------------------------------------

    def list_dead_letters(self, topic: str, group: str | None = None, *,
                          limit: int | None = None) -> list[DeadLetter]:
        """Dead letters of ``group`` (required: each group has its own queue)."""
        out: list[DeadLetter] = []
        with self._dead_letter_scan(topic, self._require_group(group)) as scan:
            for _, record in scan:
                out.append(record)
                if limit is not None and len(out) >= limit:
                    break
        return out

    def replay_dead_letters(self, topic: str, group: str | None = None,
                            ids: Collection[str] | None = None, *,
                            to_topic: bool = False) -> int:
        """Publish dead letters back (to the group's queue, or the topic's exchange)
        with attempts reset; each is acked off the dead-letter queue only after its
        publish was confirmed."""
        group = self._require_group(group)
        count = 0
        with self._dead_letter_scan(topic, group) as scan:
            for (channel, tag), record in scan:
                if not selected(record, None, ids):
                    continue
                wire = codec.replay_headers(record)
                wire.pop(codec.MESSAGE_ID, None)
                props = self._properties(record.id, wire)
                payload = body_bytes(record.message.raw_body)
                if to_topic:
                    channel.basic_publish(self.exchange_name(topic), topic, payload, props,
                                          mandatory=True)
                else:
                    channel.basic_publish("", self.queue_name(topic, group), payload, props,
                                          mandatory=True)
                channel.basic_ack(tag)
                count += 1
        return count

    def purge_dead_letters(self, topic: str, group: str | None = None,
                           ids: Collection[str] | None = None) -> int:
        group = self._require_group(group)
        count = 0
        with self._dead_letter_scan(topic, group) as scan:
            for (channel, tag), record in scan:
                if selected(record, None, ids):
                    channel.basic_ack(tag)
                    count += 1
        return count

    # -- the I/O thread -----------------------------------------------------------

    def _loop(self) -> None:
        forever = reconnecting(_CONNECTION_ERRORS, logger=log, what="RabbitMQ reconnect",
                               attempts=None, max_wait=5.0, until=self._closed)
        while not self._closed.is_set():
            try:
                if self._conn is None:
                    forever(self._reconnect)
                    continue
                self._run_ops()
                self._conn.process_data_events(time_limit=1.0)
            except _CONNECTION_ERRORS as exc:
                if self._closed.is_set():
                    break
                log.warning("%s: connection lost (%r); reconnecting", self.name, exc)
                self._lost()
            except Exception:
                log.exception("%s: unexpected error in the I/O loop", self.name)
                self._lost()
        self._shutdown()

    def _connect(self, retrying: Any) -> None:
        def connect() -> None:
            conn = pika.BlockingConnection(self._params)
            channel = conn.channel()
            channel.confirm_delivery()
            channel.basic_qos(prefetch_count=self.prefetch)
            self._conn, self._channel = conn, channel
            self._generation += 1

        retrying(connect)

    def _reconnect(self) -> None:
        if self._closed.is_set():
            return
        self._connect(lambda fn: fn())
        for queue, (topic, group) in list(self._routes.items()):
            self._consume(self._channel, queue, topic, group)
        log.info("%s: reconnected", self.name)

    def _lost(self) -> None:
        conn, self._conn, self._channel = self._conn, None, None
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
        if self._conn is None:
            return
        try:
            self._run_ops()
            for tag in list(self._tags):
                self._channel.basic_cancel(tag)
            with self._cond:
                unused = [m for buffer in self._buffers.values() for m in buffer]
                for buffer in self._buffers.values():
                    buffer.clear()
            for message in unused:  # prefetched, never handed out: not an attempt
                self._requeue(self._channel, message=message, delay=0.0,
                              attempt=message.attempt)
            self._conn.close()
        except Exception:
            log.debug("%s: closing failed", self.name, exc_info=True)
        self._conn = self._channel = None

    def _submit(self, fn: Callable[[Any], T], *, wait: bool) -> Future[T] | None:
        future: Future[T] | None = Future() if wait else None
        with self._ops_lock:
            self._ops.append((fn, future))
            wake = not self._wake_pending
            self._wake_pending = True
        if wake:
            self._wake()
        return future

    def _call(self, fn: Callable[[Any], T]) -> T:
        """Run ``fn(channel)`` on the I/O thread and return its result."""
        if threading.current_thread() is self._thread:
            return fn(self._channel)
        if self._closed.is_set():
            raise pika.exceptions.ConnectionWrongStateError("the broker is closed")
        future = self._submit(fn, wait=True)
        assert future is not None
        while True:
            try:
                return future.result(timeout=1.0)
            except TimeoutError:
                if not self._thread.is_alive():
                    raise pika.exceptions.ConnectionWrongStateError(
                        "the broker is closed") from None

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
        while True:
            with self._ops_lock:
                if not self._ops:
                    self._wake_pending = False
                    return
                fn, future = self._ops.popleft()
            if future is not None and not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(self._channel)
            except BaseException as exc:
                if future is not None:
                    future.set_exception(exc)
                else:
                    log.warning("%s: background operation failed: %r", self.name, exc)
                if isinstance(exc, _CONNECTION_ERRORS):
                    raise
            else:
                if future is not None:
                    future.set_result(result)

    # -- I/O-thread helpers (run with the channel) ------------------------------------

    def _requeue(self, channel: Any, *, message: Message, delay: float,
                 attempt: int | None = None) -> None:
        """Publish the redelivery copy (through a retry queue when delayed), confirmed,
        then ack the delivery."""
        r = self._receipt(message)
        if r.generation != self._generation:
            return  # the connection that delivered it is gone: the server redelivers it
        wire = codec.redelivery_headers(message, group=r.group, with_id=False,
                                        attempt=attempt)
        target = r.queue
        if delay > 0:
            target = self._declare_retry_queue(channel, r.queue, delay_bucket_ms(delay))
        channel.basic_publish("", target, body_bytes(message.raw_body),
                              self._properties(message.id, wire), mandatory=True)
        self._settle(channel, r)

    def _settle(self, channel: Any, r: _Receipt) -> None:
        if r.generation == self._generation:
            channel.basic_ack(r.delivery_tag)

    def _on_message(self, channel: Any, method: Any, properties: Any, body: bytes) -> None:
        queue = self._tags[method.consumer_tag]
        topic, group = self._routes[queue]
        raw = properties.headers or {}
        redeliveries = raw.get("x-delivery-count")
        if redeliveries is None:
            redeliveries = 1 if method.redelivered else 0
        t = codec.split_transport(raw, drop=_BROKER_HEADERS)
        message = Message(
            body,
            id=t.id or properties.message_id or f"{queue}:{method.delivery_tag}",
            key=t.key,
            topic=topic,
            headers=t.headers,
            timestamp=t.timestamp or properties.timestamp,
            attempt=codec.attempt_of(t.headers, int(redeliveries)),
        )
        message.receipt = _Receipt(self._generation, method.delivery_tag, queue, group)
        with self._cond:
            self._buffers.setdefault(queue, deque()).append(message)
            self._cond.notify_all()

    def _start_consuming(self, channel: Any, *, topic: str, group: str) -> None:
        queue = self.queue_name(topic, group)
        if queue in self._routes:
            return
        self._declare_group(channel, topic, group)
        self._routes[queue] = (topic, group)
        self._consume(channel, queue, topic, group)

    def _consume(self, channel: Any, queue: str, topic: str, group: str) -> None:
        tag = f"{self.name}-{next(self._ids)}"
        self._tags[tag] = queue
        channel.basic_consume(queue, self._on_message, auto_ack=False, consumer_tag=tag)

    def _declare_group(self, channel: Any, topic: str, group: str) -> None:
        exchange = self._declare_exchange(channel, self.exchange_name(topic))
        queue = self._declare_queue(channel, self.queue_name(topic, group))
        if self.declare and f"bind:{queue}" not in self._declared:
            channel.queue_bind(queue, exchange, routing_key=topic)
            self._declared.add(f"bind:{queue}")

    def _declare_exchange(self, channel: Any, exchange: str) -> str:
        if self.declare and f"exchange:{exchange}" not in self._declared:
            channel.exchange_declare(exchange, exchange_type="fanout", durable=True)
            self._declared.add(f"exchange:{exchange}")
        return exchange

    def _queue_arguments(self) -> dict[str, Any]:
        return {} if self.queue_type is None else {"x-queue-type": self.queue_type}

    def _declare_queue(self, channel: Any, queue: str) -> str:
        if self.declare and f"queue:{queue}" not in self._declared:
            channel.queue_declare(queue, durable=True, arguments=self._queue_arguments())
            self._declared.add(f"queue:{queue}")
        return queue

    def _declare_dead_letter_queue(self, channel: Any, queue: str) -> str:
        """A classic queue: dead letters are inspected by fetching and returning them,
        which a quorum queue's delivery limit would eventually punish."""
        name = self.dead_letter_queue_name(queue)
        if self.declare and f"queue:{name}" not in self._declared:
            args = {} if self.queue_type is None else {"x-queue-type": "classic"}
            channel.queue_declare(name, durable=True, arguments=args)
            self._declared.add(f"queue:{name}")
        return name

    def _declare_retry_queue(self, channel: Any, queue: str, delay_ms: int) -> str:
        """Declared on every use: ``x-expires`` deletes a retry queue a minute after its
        last use, always after its last message has moved on."""
        name = self.retry_queue_name(queue, delay_ms)
        args: dict[str, Any] = {
            **self._queue_arguments(),
            "x-message-ttl": delay_ms,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": queue,
            "x-expires": delay_ms + 60_000,
        }
        if self.queue_type == "quorum":  # at-least-once dead-lettering back to the queue
            args.update({"x-dead-letter-strategy": "at-least-once",
                         "x-overflow": "reject-publish"})
        channel.queue_declare(name, durable=True, arguments=args)
        return name

    @staticmethod
    def _properties(message_id: str, headers: Mapping[str, str]) -> Any:
        return pika.BasicProperties(
            message_id=message_id, headers=dict(headers), delivery_mode=2,
            timestamp=int(time.time()),
        )

    # -- admin helpers (own short-lived connection, caller's thread) --------------------

    @staticmethod
    def _require_group(group: str | None) -> str:
        if not group:
            raise ValueError("RabbitMQ keeps dead letters per group queue: pass a group")
        return group

    @contextmanager
    def _dead_letter_scan(
        self, topic: str, group: str,
    ) -> Iterator[Iterator[tuple[tuple[Any, int], DeadLetter]]]:
        """Every message of the group's dead-letter queue, fetched unacked; whatever is
        not acked is returned to the queue when the scan ends."""
        conn = pika.BlockingConnection(self._params)
        try:
            channel = conn.channel()
            channel.confirm_delivery()
            dlq = self.dead_letter_queue_name(self.queue_name(topic, group))
            try:
                depth = channel.queue_declare(dlq, passive=True).method.message_count
            except pika.exceptions.ChannelClosedByBroker as exc:
                if exc.reply_code != 404:
                    raise
                depth = 0  # no dead letter yet: the queue does not exist

            def scan() -> Iterator[tuple[tuple[Any, int], DeadLetter]]:
                for _ in range(depth):
                    method, props, body = channel.basic_get(dlq, auto_ack=False)
                    if method is None:
                        return
                    record = codec.read_dead_letter(
                        body, props.headers or {}, fallback_id=props.message_id or "",
                        fallback_topic=topic,
                        location={"dlq": dlq, "delivery_tag": str(method.delivery_tag)},
                    )
                    yield (channel, method.delivery_tag), record

            yield scan()
        finally:
            conn.close()

    @staticmethod
    def _receipt(message: Message) -> _Receipt:
        receipt = message.receipt
        if not isinstance(receipt, _Receipt):
            raise ValueError(f"{message!r} was not delivered by a RabbitMQBroker")
        return receipt

    def __repr__(self) -> str:
        return f"RabbitMQBroker(name={self.name!r})"
