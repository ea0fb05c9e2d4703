"""FastStream: msgpatterns' retry schedule, dead letters and idempotency for
FastStream subscribers (RabbitMQ queues and Redis Streams).

Wire it as a FastStream middleware (on the broker, or on a router for some
subscribers only)::

    broker = RabbitBroker(url, middlewares=[MsgpatternsMiddleware(policy)])

Guarantees, for every delivery of a RabbitMQ queue subscriber or a Redis stream
subscriber (one message at a time, not ``batch=True``):

* The decision is :func:`msgpatterns.settlement.settle` (``RetryPolicy.decide``), the
  one the Consumer makes: success acks; ``NeedRetry()`` retries in-process (awaiting the
  backoff, ``local_retries`` times); ``NeedRetry(delay)`` and ordinary errors redeliver
  a copy after the policy's delay; ``Reject``, ``fatal`` errors and the last attempt
  dead-letter the message. FastStream's own ``AckMessage`` / ``NackMessage`` /
  ``RejectMessage`` pass through untouched.
* The attempt count is durable: the copy carries ``x-msgpatterns-attempt`` (and the
  failure history) in its headers; a RabbitMQ quorum queue's ``x-delivery-count``
  adds deliveries that died with their consumer.
* A copy or dead letter is published (RabbitMQ: publisher-confirmed) *before* FastStream
  acks the original: a crash in between duplicates it, never loses it. If that publish
  fails the original is nacked (``NackMessage``): handed back, never acked.
* Delays are never early. RabbitMQ: the copy waits in a TTL queue
  ``<queue>.retry.<ms>`` (the delay rounded *up* to two significant digits) that
  dead-letters back to ``<queue>`` - the same topology as
  :class:`~msgpatterns.brokers.RabbitMQBroker`. Redis Streams have no delayed delivery:
  the subscriber holds the unacked delivery for the delay (monotonic clock), then adds
  the copy to the stream and acks the original. Set ``StreamSub(min_idle_time=...)``
  above the longest delay so that a delivery held by a consumer that died is claimed
  by another one.
* Dead letters go next to the source - RabbitMQ queue ``<queue>.dlq`` (classic,
  durable), Redis stream ``<stream>:dlq`` - with the full
  :class:`~msgpatterns.DeadLetter` record in the broker adapters' wire format, so
  ``msgpatterns dlq`` and the adapters read them; or to ``dead_letters`` (any
  :class:`~msgpatterns.deadletter.DeadLetterStore`) when given.
* Ids: ``message.id`` is the publisher's (RabbitMQ ``message_id``; on Redis the
  library's id header or FastStream's ``message_id`` header, else ``<stream>/<entry
  id>``), kept by every retry copy; never FastStream's per-delivery random id.

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
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Protocol

from msgpatterns._escape import escape_control
from msgpatterns._extras import require
from msgpatterns.brokers import _codec as codec
from msgpatterns.deadletter import DeadLetter, DeadLetterStore
from msgpatterns.errors import ConfigurationError, describe
from msgpatterns.message import Message
from msgpatterns.retry import RetryPolicy
from msgpatterns.settlement import Ack, DeadLetterIt, RetryLater, RetryNow, settle

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
_RABBIT_HEADERS = ("x-death", "x-delivery-count", "x-first-death-exchange",
                   "x-first-death-queue", "x-first-death-reason", "x-last-death-exchange",
                   "x-last-death-queue", "x-last-death-reason")


class _Route(Protocol):
    """Where one subscriber's deliveries come from, and how copies go back there."""

    group: str

    def message(self, msg: Any) -> Message: ...

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

    def message(self, msg: Any) -> Message:
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
                       attempt=codec.attempt_of(t.headers, redeliveries))

    async def _declare(self, name: str, arguments: Any) -> None:
        from faststream.rabbit import RabbitQueue

        await self.broker.declare_queue(RabbitQueue(name, durable=True, arguments=arguments))

    async def retry(self, msg: Any, message: Message, decision: RetryLater) -> None:
        from msgpatterns.brokers.rabbitmq import RabbitMQBroker, delay_bucket_ms

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
        from msgpatterns.brokers.rabbitmq import RabbitMQBroker

        dlq = RabbitMQBroker.dead_letter_queue_name(self.queue)
        await self._declare(dlq, {})  # classic, durable: as the adapter declares it
        wire = codec.dead_letter_headers(record, with_id=False)  # AMQP message_id has it
        await self.broker.publish(codec.dead_letter_body(record), queue=dlq, headers=wire,
                                  message_id=record.message.id, persist=True)


class _RedisStreamRoute:
    def __init__(self, broker: Any, stream: str, group: str) -> None:
        self.broker = broker
        self.stream = stream
        self.group = group

    def message(self, msg: Any) -> Message:
        t = codec.split_transport(msg.headers or {})
        ids = msg.raw_message.get("message_ids") or []
        entry = f"{self.stream}/{codec.text(ids[0])}" if ids else None
        return Message(msg.body, id=t.id or t.headers.get("message_id") or entry,
                       key=t.key, topic=self.stream, headers=t.headers,
                       timestamp=t.timestamp, attempt=codec.attempt_of(t.headers))

    async def retry(self, msg: Any, message: Message, decision: RetryLater) -> None:
        due = time.monotonic() + decision.delay
        while (left := due - time.monotonic()) > 0:  # asyncio may wake a tick early
            await asyncio.sleep(left)
        await self.broker.publish(msg.body, stream=self.stream,
                                  headers=_copy_headers(message, decision.headers),
                                  correlation_id=msg.correlation_id)

    async def dead_letter(self, record: DeadLetter) -> None:
        from msgpatterns.brokers.redis_streams import RedisStreamsBroker

        fields = {"body": codec.dead_letter_body(record),
                  "headers": codec.dumps_headers(codec.dead_letter_headers(record))}
        client = await self.broker.connect()
        await client.xadd(RedisStreamsBroker.dead_letter_stream(self.stream), fields)


def _route(msg: Any, context: Any) -> _Route:
    """The route of the subscriber handling ``msg``; refuses what it cannot serve."""
    subscriber = context.get_local("handler_")
    broker = context.get("broker")
    kind = type(msg).__module__
    if kind.startswith("faststream.rabbit") and hasattr(subscriber, "queue"):
        return _RabbitRoute(broker, subscriber.queue.name)
    stream = getattr(subscriber, "stream_sub", None)
    if kind.startswith("faststream.redis") and stream is not None and not stream.batch:
        return _RedisStreamRoute(broker, stream.name, stream.group or "")
    raise ConfigurationError(
        f"MsgpatternsMiddleware serves RabbitMQ queue subscribers and Redis stream "
        f"subscribers (one message at a time), not {type(subscriber).__name__}"
    )


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
        if policy is not None and not isinstance(policy, RetryPolicy):
            raise ConfigurationError(f"policy must be a RetryPolicy, got {policy!r}")
        if dead_letters is not None and not callable(getattr(dead_letters, "put", None)):
            raise ConfigurationError(
                f"dead_letters must be a DeadLetterStore (with put), got {dead_letters!r}")
        self.policy = policy if policy is not None else RetryPolicy()
        self.dead_letters = dead_letters
        self.group = group

    def __call__(self, msg: Any, /, *, context: Any) -> BaseMiddleware:
        return _SettlingMiddleware(msg, context=context, config=self)


class _SettlingMiddleware(BaseMiddleware):
    def __init__(self, msg: Any, /, *, context: Any, config: MsgpatternsMiddleware) -> None:
        super().__init__(msg, context=context)
        self.config = config

    async def consume_scope(self, call_next: Callable[[Any], Awaitable[Any]],
                            msg: Any) -> Any:
        route = _route(msg, self.context)
        message = route.message(msg)
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

