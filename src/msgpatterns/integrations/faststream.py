"""FastStream: msgpatterns' retry schedule, dead letters and idempotency for
FastStream subscribers (RabbitMQ queues, Redis streams and lists, Kafka, NATS
JetStream).

Wire it as a FastStream middleware (on the broker, or on a router for some
subscribers only), and check the subscribers when the app starts::

    middleware = MsgpatternsMiddleware(policy)
    broker = RabbitBroker(url, middlewares=[middleware])
    app = FastStream(broker, on_startup=[lambda: middleware.check(broker)])

Guarantees, for every delivery of a supported subscriber (one message at a time, not
``batch=True``; others are refused by :meth:`MsgpatternsMiddleware.check`, or at their
first message):

* The decision is :func:`msgpatterns.settlement.settle` (``RetryPolicy.decide``), the
  one the Consumer makes: success acks; ``NeedRetry()`` retries in-process (awaiting the
  backoff, ``local_retries`` times); ``NeedRetry(delay)`` and ordinary errors redeliver
  a copy after the policy's delay; ``Reject``, ``fatal`` errors and the last attempt
  dead-letter the message. FastStream's own ``AckMessage`` / ``NackMessage`` /
  ``RejectMessage`` pass through untouched.
* The attempt count is durable: the copy carries ``x-msgpatterns-attempt`` (and the
  failure history) in its headers; a RabbitMQ quorum queue's ``x-delivery-count``
  adds deliveries that died with their consumer, on NATS JetStream ``num_delivered``
  does (a copy fetched before it is due is NAKed with the time it still has to wait,
  which is not counted).
* A copy or dead letter is stored (RabbitMQ: publisher-confirmed) *before* FastStream
  acks the original: a crash in between duplicates it, never loses it. If that fails
  the original is nacked (``NackMessage``): handed back, never acked.
* Delays are never early. RabbitMQ: the copy waits in a TTL queue
  ``<queue>.retry.<ms>`` (the delay rounded *up* to two significant digits) that
  dead-letters back to ``<queue>`` - the same topology as
  :class:`~msgpatterns.brokers.RabbitMQBroker`. Redis (streams and lists): the copy
  waits in a Redis sorted set and a mover task adds it when due, so the subscriber
  goes on with its next message. Kafka: the subscriber holds the delivery for the
  delay (the partition stays in order), then produces the copy.
* Dead letters go next to the source - RabbitMQ queue ``<queue>.dlq`` (classic,
  durable), Redis stream ``<stream or list>:dlq``, Kafka topic ``<topic>.DLT``, NATS
  subject ``<subject>.__dlq`` - with the full :class:`~msgpatterns.DeadLetter` record
  in the broker adapters' wire format, so ``msgpatterns dlq`` and the adapters read
  them; or to ``dead_letters`` (any
  :class:`~msgpatterns.deadletter.DeadLetterStore`) when given.
* Ids: ``message.id`` is the publisher's (RabbitMQ ``message_id``; elsewhere the
  library's id header or a ``message_id`` header, else the broker's position: Redis
  ``<stream>/<entry id>``, Kafka ``<topic>/<partition>/<offset>``, NATS
  ``<stream>:<sequence>``), kept by every retry copy; never FastStream's per-delivery
  random id.

Idempotency: the handler gets the msgpatterns :class:`~msgpatterns.Message` through
the :data:`Delivery` annotation, so ``@idempotent(checker)`` with its default key
(``message.key or message.id``) works on a sync handler, and on an ``async def``
handler with an async checker (``AsyncRedisChecker``, ``AsyncSqlChecker``,
``AsyncTransactionalSqlChecker``, ``MemoryChecker``)::

    @broker.subscriber("orders")
    @idempotent(AsyncRedisChecker(redis_url))
    async def handle(body: dict, delivery: Delivery) -> None: ...

The key becomes DONE only after the handler's body returned; a body that fails
releases it and the middleware's retry runs it again.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import math
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Protocol

from msgpatterns import headers as h
from msgpatterns._escape import escape_control
from msgpatterns._extras import require
from msgpatterns.brokers import codec
from msgpatterns.deadletter import DeadLetter, DeadLetterStore
from msgpatterns.errors import ConfigurationError, describe
from msgpatterns.message import Message
from msgpatterns.retry import RetryPolicy
from msgpatterns.settlement import (
    Ack,
    DeadLetterIt,
    RetryLater,
    RetryNow,
    checked_policy_and_store,
    settle,
)

require("faststream", "faststream")

from faststream import BaseMiddleware, Context  # noqa: E402
from faststream.exceptions import HandlerException, NackMessage  # noqa: E402

__all__ = ["CONTEXT_KEY", "Delivery", "MsgpatternsMiddleware"]

log = logging.getLogger("msgpatterns.integrations.faststream")

#: The FastStream context name of the delivery's msgpatterns Message.
CONTEXT_KEY = "msgpatterns_message"
#: Annotate a handler parameter with it to receive the msgpatterns Message (id, key,
#: attempt, headers): what ``@idempotent``'s default key reads.
Delivery = Annotated[Message, Context(CONTEXT_KEY)]

# Headers RabbitMQ adds when a retry queue dead-letters a copy back.
#: KafkaBroker's default dead_letter_suffix: where ``msgpatterns dlq`` looks.
_KAFKA_DEAD_LETTER_SUFFIX = ".DLT"

_RABBIT_HEADERS = ("x-death", "x-delivery-count", "x-first-death-exchange",
                   "x-first-death-queue", "x-first-death-reason", "x-last-death-exchange",
                   "x-last-death-queue", "x-last-death-reason")


class _Route(Protocol):
    """Where one subscriber's deliveries come from, and how copies go back there."""

    group: str

    def start(self) -> None: ...

    async def park(self, msg: Any, bounds: h.WireBounds) -> bool: ...

    def message(self, msg: Any, bounds: h.WireBounds) -> Message: ...

    async def retry(self, msg: Any, message: Message, decision: RetryLater) -> None: ...

    async def dead_letter(self, record: DeadLetter) -> None: ...


def _copy_headers(message: Message, headers: dict[str, str] | Any) -> dict[str, str]:
    """The redelivered copy's headers: the decision's (attempt + 1, failure history)
    plus the transport headers that keep id, key and publish time."""
    return codec.wire_headers(dict(headers), message_id=message.id, key=message.key,
                              timestamp=message.timestamp)


class _RabbitRoute:
    def __init__(self, broker: Any, queue: str) -> None:
        self.broker = broker
        self.queue = queue
        self.group = ""

    def start(self) -> None:
        pass

    async def park(self, msg: Any, bounds: h.WireBounds) -> bool:
        return False

    def message(self, msg: Any, bounds: h.WireBounds) -> Message:
        raw = msg.raw_message
        table = getattr(raw, "headers", None) or {}
        count = table.get("x-delivery-count")
        redeliveries = count if isinstance(count, int) and not isinstance(count, bool) \
            else int(bool(getattr(raw, "redelivered", False)))
        t = codec.split_transport(table, drop=_RABBIT_HEADERS)
        stamp = getattr(raw, "timestamp", None)
        timestamp = t.timestamp if t.timestamp is not None else (
            stamp.timestamp() if stamp is not None else None)
        return Message(msg.body, id=t.id or getattr(raw, "message_id", None) or None,
                       key=t.key, topic=self.queue, headers=t.headers, timestamp=timestamp,
                       attempt=codec.attempt_of(t.headers, redeliveries, bounds))

    async def _declare(self, name: str, arguments: Any) -> None:
        from faststream.rabbit import RabbitQueue

        await self.broker.declare_queue(RabbitQueue(name, durable=True, arguments=arguments))

    async def retry(self, msg: Any, message: Message, decision: RetryLater) -> None:
        from msgpatterns.brokers.rabbitmq.broker import RabbitMQBroker, delay_bucket_ms

        target = self.queue
        if decision.delay > 0:
            ms = delay_bucket_ms(decision.delay)
            target = RabbitMQBroker.retry_queue_name(self.queue, ms)
            await self._declare(target, {
                "x-message-ttl": ms, "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": self.queue, "x-expires": ms + 60_000,
            })
        await self.broker.publish(
            msg.body, queue=target, headers=_copy_headers(message, decision.headers),
            message_id=message.id, correlation_id=msg.correlation_id,
            content_type=msg.content_type, persist=True,
        )

    async def dead_letter(self, record: DeadLetter) -> None:
        from msgpatterns.brokers.rabbitmq.broker import RabbitMQBroker

        dlq = RabbitMQBroker.dead_letter_queue_name(self.queue)
        await self._declare(dlq, {})  # classic, durable: as the adapter declares it
        wire = codec.dead_letter_headers(record, with_id=False)  # AMQP message_id has it
        await self.broker.publish(codec.dead_letter_body(record), queue=dlq, headers=wire,
                                  message_id=record.message.id, persist=True)


class _RedisDelays:
    """Delayed copies for a FastStream Redis broker's subscribers, kept in Redis until
    they are due: the copy is stored (``HSET`` + ``ZADD`` in one ``MULTI``) before the
    original is acked, and a mover task on the broker's loop sends each copy to its
    stream or list once due (wall clock, never early), then deletes it. The mover first
    moves a due copy's score one lease ahead: a mover that dies between sending and
    deleting leaves it to be sent again after the lease (a duplicate, never a loss)."""

    LEASE_MS = 30_000
    POLL = 0.5  # seconds between looks for copies scheduled by other processes

    _CLAIM = """
    local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, 100)
    local out = {}
    for _, id in ipairs(due) do
      redis.call('ZADD', KEYS[1], ARGV[2], id)
      out[#out + 1] = id
      out[#out + 1] = redis.call('HGET', KEYS[2], id) or ''
    end
    return out
    """

    def __init__(self, broker: Any) -> None:
        self.broker = broker
        self.keys: set[str] = set()
        self.wake: asyncio.Event | None = None
        self.task: asyncio.Task[None] | None = None

    @staticmethod
    def key(kind: str, name: str) -> str:
        return f"{name}:fs-delayed" if kind == "stream" else f"{name}:fs-delayed-list"

    async def schedule(self, kind: str, name: str, body: bytes, headers: dict[str, str],
                       correlation_id: str | None, delay: float) -> None:
        """Store the copy in Redis, due ``delay`` seconds from now (rounded up)."""
        key = self.key(kind, name)
        due = math.ceil((time.time() + delay) * 1000)
        member = uuid.uuid4().hex
        payload = json.dumps({"kind": kind, "name": name, "headers": headers,
                              "correlation_id": correlation_id,
                              "body": base64.b64encode(body).decode("ascii")})
        client = await self.broker.connect()
        async with client.pipeline(transaction=True) as pipe:
            pipe.hset(f"{key}:data", member, payload)
            pipe.zadd(key, {member: due})
            await pipe.execute()
        self.watch(kind, name)

    def watch(self, kind: str, name: str) -> None:
        """Move the due copies of ``name`` from now on (and those a crash left)."""
        key = self.key(kind, name)
        alive = self.task is not None and not self.task.done()
        if alive and key in self.keys:
            return
        self.keys.add(key)
        if not alive:
            self.wake = asyncio.Event()
            self.task = asyncio.get_running_loop().create_task(self._run())
        assert self.wake is not None
        self.wake.set()

    async def _run(self) -> None:
        assert self.wake is not None
        seen_running = False
        real: bool | None = None
        while True:
            running = bool(getattr(self.broker, "running", False))
            if seen_running and not running:
                return  # the broker stopped; the copies wait in Redis for the next start
            seen_running = seen_running or running
            wait = self.POLL
            if running:
                try:
                    if real is None:
                        real = await _real_redis(self.broker)
                    if not real:
                        return  # FastStream's TestRedisBroker: nothing is stored
                    wait = min(wait, await self._move_due())
                except Exception as exc:  # a lost connection: try again shortly
                    log.warning("moving delayed FastStream retries failed (%s); retrying",
                                describe(exc))
            self.wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), max(wait, 0.005))

    async def _move_due(self) -> float:
        """Send every due copy; seconds until the next one is due (at most POLL)."""
        client = await self.broker.connect()
        wait = self.POLL
        for key in sorted(self.keys):
            now = math.floor(time.time() * 1000)
            claimed = await client.eval(self._CLAIM, 2, key, f"{key}:data", now,
                                        now + self.LEASE_MS)
            for member, raw in zip(claimed[::2], claimed[1::2], strict=True):
                if raw:
                    await self._send(json.loads(raw))
                async with client.pipeline(transaction=True) as pipe:
                    pipe.zrem(key, member)
                    pipe.hdel(f"{key}:data", member)
                    await pipe.execute()
            first = await client.zrange(key, 0, 0, withscores=True)
            if first:
                wait = min(wait, max(0.0, first[0][1] / 1000 - time.time()))
        return wait

    async def _send(self, copy: dict[str, Any]) -> None:
        body = base64.b64decode(copy["body"])
        target = {"stream": copy["name"]} if copy["kind"] == "stream" else {
            "list": copy["name"]}
        await self.broker.publish(body, headers=copy["headers"],
                                  correlation_id=copy["correlation_id"], **target)


async def _real_redis(broker: Any) -> bool:
    """True when ``broker`` talks to a Redis server (not FastStream's test double)."""
    from redis.asyncio import Redis

    return isinstance(await broker.connect(), Redis)


def _redis_delays(broker: Any) -> _RedisDelays:
    """The one :class:`_RedisDelays` of ``broker``."""
    delays: _RedisDelays | None = _DELAYS.get(broker)
    if delays is None:
        delays = _DELAYS[broker] = _RedisDelays(broker)
    return delays


_DELAYS: weakref.WeakKeyDictionary[Any, _RedisDelays] = weakref.WeakKeyDictionary()


async def _redis_dead_letter(broker: Any, source: str, record: DeadLetter) -> None:
    """Add the record to the Redis stream ``<source>:dlq`` (the adapter's format)."""
    from msgpatterns.brokers.redis.broker import RedisStreamsBroker

    fields = {"body": codec.dead_letter_body(record),
              "headers": codec.dumps_headers(codec.dead_letter_headers(record))}
    client = await broker.connect()
    await client.xadd(RedisStreamsBroker.dead_letter_stream(source), fields)


class _RedisStreamRoute:
    kind = "stream"

    def __init__(self, broker: Any, stream: str, group: str) -> None:
        self.broker = broker
        self.stream = stream
        self.group = group

    def start(self) -> None:
        _redis_delays(self.broker).watch(self.kind, self.stream)

    async def park(self, msg: Any, bounds: h.WireBounds) -> bool:
        return False

    def message(self, msg: Any, bounds: h.WireBounds) -> Message:
        t = codec.split_transport(msg.headers or {})
        ids = msg.raw_message.get("message_ids") or []
        entry = f"{self.stream}/{codec.text(ids[0])}" if ids else None
        return Message(msg.body, id=t.id or t.headers.get("message_id") or entry,
                       key=t.key, topic=self.stream, headers=t.headers,
                       timestamp=t.timestamp, attempt=codec.attempt_of(t.headers, 0, bounds))

    async def retry(self, msg: Any, message: Message, decision: RetryLater) -> None:
        headers = _copy_headers(message, decision.headers)
        if decision.delay > 0:
            if await _real_redis(self.broker):
                await _redis_delays(self.broker).schedule(
                    self.kind, self.stream, bytes(msg.body), headers, msg.correlation_id,
                    decision.delay)
                return
            await _hold(decision.delay)  # a test double (TestRedisBroker): no Redis
        await self.broker.publish(msg.body, headers=headers,
                                  correlation_id=msg.correlation_id,
                                  **{self.kind: self.stream})

    async def dead_letter(self, record: DeadLetter) -> None:
        await _redis_dead_letter(self.broker, self.stream, record)


class _RedisListRoute(_RedisStreamRoute):
    kind = "list"

    def __init__(self, broker: Any, name: str) -> None:
        super().__init__(broker, name, "")

    def message(self, msg: Any, bounds: h.WireBounds) -> Message:
        t = codec.split_transport(msg.headers or {})
        return Message(msg.body, id=t.id or t.headers.get("message_id") or None,
                       key=t.key, topic=self.stream, headers=t.headers,
                       timestamp=t.timestamp, attempt=codec.attempt_of(t.headers, 0, bounds))



class _KafkaRoute:
    def __init__(self, broker: Any, group: str) -> None:
        self.broker = broker
        self.group = group

    def start(self) -> None:
        pass

    async def park(self, msg: Any, bounds: h.WireBounds) -> bool:
        return False

    def message(self, msg: Any, bounds: h.WireBounds) -> Message:
        raw = msg.raw_message
        t = codec.split_transport(msg.headers or {})
        key = t.key
        if key is None and raw.key is not None:
            key = raw.key.decode("utf-8", "backslashreplace") \
                if isinstance(raw.key, bytes) else str(raw.key)
        return Message(msg.body, id=t.id or t.headers.get("message_id")
                       or f"{raw.topic}/{raw.partition}/{raw.offset}",
                       key=key, topic=raw.topic, headers=t.headers,
                       timestamp=t.timestamp if t.timestamp is not None else (
                           raw.timestamp / 1000 if raw.timestamp else None),
                       attempt=codec.attempt_of(t.headers, 0, bounds), partition=raw.partition,
                       offset=raw.offset)

    async def retry(self, msg: Any, message: Message, decision: RetryLater) -> None:
        # Kafka has no delayed delivery and keeps a partition in order: the subscriber
        # holds the delivery for the delay, then appends the copy to the topic.
        await _hold(decision.delay)
        raw = msg.raw_message
        await self.broker.publish(msg.body, topic=raw.topic, key=raw.key,
                                  headers=_copy_headers(message, decision.headers),
                                  correlation_id=msg.correlation_id)

    async def dead_letter(self, record: DeadLetter) -> None:
        topic = record.message.topic + _KAFKA_DEAD_LETTER_SUFFIX
        key = record.message.key.encode() if record.message.key is not None else None
        await self.broker.publish(codec.dead_letter_body(record), topic=topic, key=key,
                                  headers=codec.dead_letter_headers(record))


class _NatsRoute:
    """NATS JetStream: a retry is a copy published to the subject with the next attempt
    and its due time in its headers (like ``NatsJetStreamBroker``); a copy fetched
    before it is due goes back with JetStream's delayed NAK, which the server keeps, so
    the subscriber never holds it. The attempt is the copy's header, not JetStream's
    ``num_delivered`` alone: a NATS 2.9 server can report a redelivery of a
    pull consumer with a delivery count of 1."""

    def __init__(self, broker: Any, stream: str, group: str) -> None:
        self.broker = broker
        self.stream = stream
        self.group = group

    def start(self) -> None:
        pass

    @staticmethod
    def _transport(msg: Any) -> tuple[codec.Transport, int]:
        t = codec.split_transport(msg.headers or {})
        parked = 1 if t.headers.pop(codec.PARKED, None) else 0
        return t, parked

    async def park(self, msg: Any, bounds: h.WireBounds) -> bool:
        """NAK a copy that is not due yet with the time it still has to wait."""
        t, _ = self._transport(msg)
        now = time.time()
        due_at = h.honoured_due_at(t.due_at, now, bounds)  # beyond the policy: due now
        if due_at is None:
            return False
        await msg.nack(delay=due_at - now)
        return True

    def message(self, msg: Any, bounds: h.WireBounds) -> Message:
        raw = msg.raw_message
        meta = raw.metadata
        t, parked = self._transport(msg)
        seq = f"{meta.stream}:{meta.sequence.stream}"
        redeliveries = max(0, meta.num_delivered - 1 - parked)
        return Message(msg.body, id=t.id or t.headers.get("message_id")
                       or t.headers.get("Nats-Msg-Id") or seq,
                       key=t.key, topic=raw.subject, headers=t.headers,
                       timestamp=t.timestamp if t.timestamp is not None else (
                           meta.timestamp.timestamp() if meta.timestamp else None),
                       attempt=codec.attempt_of(t.headers, redeliveries, bounds))

    async def retry(self, msg: Any, message: Message, decision: RetryLater) -> None:
        due = time.time() + decision.delay if decision.delay > 0 else None
        headers = codec.wire_headers(dict(decision.headers), message_id=message.id,
                                     key=message.key, timestamp=message.timestamp,
                                     due_at=due)
        if due is not None:
            headers[codec.PARKED] = "1"  # its first (parking) delivery is no attempt
        await self.broker.publish(msg.body, subject=msg.raw_message.subject,
                                  stream=self.stream, headers=headers,
                                  correlation_id=msg.correlation_id)

    async def dead_letter(self, record: DeadLetter) -> None:
        from msgpatterns.brokers.nats.broker import NatsJetStreamBroker

        subject = NatsJetStreamBroker.dead_letter_subject(record.message.topic)
        await self.broker.publish(codec.dead_letter_body(record), subject=subject,
                                  stream=self.stream, headers=codec.dead_letter_headers(record))


async def _hold(delay: float) -> None:
    due = time.monotonic() + delay
    while (left := due - time.monotonic()) > 0:  # asyncio may wake a tick early
        await asyncio.sleep(left)


def _route_for(subscriber: Any, broker: Any) -> _Route:
    """The route of ``subscriber``; a ConfigurationError naming why it cannot be
    served."""
    kind = type(subscriber).__module__
    name = type(subscriber).__name__
    why = "one message at a time, not batch=True"
    if kind.startswith("faststream.rabbit") and hasattr(subscriber, "queue"):
        return _RabbitRoute(broker, subscriber.queue.name)
    if kind.startswith("faststream.redis"):
        stream = getattr(subscriber, "stream_sub", None)
        if stream is not None and not stream.batch:
            return _RedisStreamRoute(broker, stream.name, stream.group or "")
        listing = getattr(subscriber, "list_sub", None)
        if listing is not None and not listing.batch:
            return _RedisListRoute(broker, listing.name)
        if stream is None and listing is None:
            why = "Redis pub/sub channels carry no acknowledgement to retry or dead-letter by"
    if kind.startswith("faststream.kafka") and "Batch" not in name:
        return _KafkaRoute(broker, getattr(subscriber, "group_id", None) or "")
    if kind.startswith("faststream.nats"):
        stream = getattr(subscriber, "stream", None)
        if stream is not None and "Batch" not in name and hasattr(stream, "name"):
            return _NatsRoute(broker, stream.name, "")
        if stream is None:
            why = ("core NATS subscribers have no acknowledgement or redelivery: "
                   "subscribe with stream=JStream(...)")
    raise ConfigurationError(
        f"MsgpatternsMiddleware serves RabbitMQ queue, Redis stream and list, Kafka and "
        f"NATS JetStream subscribers ({why}), not {name} "
        f"{getattr(subscriber, 'call_name', '')}".rstrip()
    )


def _route(msg: Any, context: Any) -> _Route:
    """The route of the subscriber handling ``msg``; refuses what it cannot serve."""
    return _route_for(context.get_local("handler_"), context.get("broker"))


class MsgpatternsMiddleware:
    """A FastStream middleware factory: pass an instance in ``middlewares=[...]`` of a
    broker or router.

    Args:
        policy: the retry policy (default ``RetryPolicy()``).
        dead_letters: a :class:`~msgpatterns.deadletter.DeadLetterStore` to keep dead
            letters in instead of the broker's dead-letter queue/stream (its ``put``
            runs in a worker thread).
        group: the group named in dead-letter records (default: the Redis consumer
            group; none on RabbitMQ, whose dead-letter queue is per queue).
    """

    def __init__(self, policy: RetryPolicy | None = None, *,
                 dead_letters: DeadLetterStore | None = None, group: str = "") -> None:
        self.policy, self.dead_letters = checked_policy_and_store(policy, dead_letters)
        self.group = group
        #: How far the library's headers on a delivery are trusted (the policy's).
        self.bounds = self.policy.wire_bounds()

    def __call__(self, msg: Any, /, *, context: Any) -> BaseMiddleware:
        return _SettlingMiddleware(msg, context=context, config=self)

    def check(self, broker: Any) -> None:
        """Refuse, with a :class:`~msgpatterns.errors.ConfigurationError` naming each
        one, the subscribers of ``broker`` under this middleware that it cannot serve;
        start moving the Redis delayed retries a previous run left. Call it when the
        app starts (``FastStream(broker, on_startup=[...])``, or before
        ``broker.start()``); without it an unsupported subscriber is refused at its
        first message."""
        problems: list[str] = []
        for subscriber in broker.subscribers:
            stack = getattr(subscriber, "_broker_middlewares", None)
            if stack is not None and self not in stack:
                continue
            try:
                route = _route_for(subscriber, broker)
            except ConfigurationError as exc:
                problems.append(str(exc))
                continue
            with contextlib.suppress(RuntimeError):  # no running loop: at first message
                route.start()
        if problems:
            raise ConfigurationError("; ".join(problems))


class _SettlingMiddleware(BaseMiddleware):
    def __init__(self, msg: Any, /, *, context: Any, config: MsgpatternsMiddleware) -> None:
        super().__init__(msg, context=context)
        self.config = config

    async def consume_scope(self, call_next: Callable[[Any], Awaitable[Any]],
                            msg: Any) -> Any:
        route = _route(msg, self.context)
        route.start()
        bounds = self.config.bounds
        if await route.park(msg, bounds):  # a retry copy fetched before it is due
            return None
        message = route.message(msg, bounds)
        group = self.config.group or route.group
        with self.context.scope(CONTEXT_KEY, message):
            decision = await self._run(call_next, msg, message, group)
        if isinstance(decision, Ack):
            return decision.result
        try:
            if isinstance(decision, RetryLater):
                log.info("message %r attempt %d failed (%s); redelivering in %.3fs",
                         message.id, message.attempt, escape_control(describe(decision.error)),
                         decision.delay)
                await route.retry(msg, message, decision)
            else:
                log.warning("message %r dead-lettered: %s", message.id,
                            escape_control(decision.reason))
                await self._dead_letter(route, decision.record)
        except Exception as exc:
            log.error("message %r: publishing its %s failed (%s); handing it back",
                      message.id, type(decision).__name__, escape_control(describe(exc)))
            raise NackMessage() from exc
        return None

    async def _run(self, call_next: Callable[[Any], Awaitable[Any]], msg: Any,
                   message: Message, group: str) -> Ack | RetryLater | DeadLetterIt:
        """Call the handler (again while the policy says retry in-process); the final
        decision. FastStream's own ack/nack/reject exceptions pass through."""
        while True:
            error: Exception | None = None
            result: Any = None
            try:
                result = await call_next(msg)
            except HandlerException:
                raise
            except Exception as exc:
                error = exc
            decision = settle(message, error, policy=self.config.policy, group=group,
                              result=result)
            if not isinstance(decision, RetryNow):
                return decision
            await asyncio.sleep(decision.delay)
            message.local_retries += 1

    async def _dead_letter(self, route: _Route, record: DeadLetter) -> None:
        store = self.config.dead_letters
        if store is None:
            await route.dead_letter(record)
        else:
            await asyncio.to_thread(store.put, record)

