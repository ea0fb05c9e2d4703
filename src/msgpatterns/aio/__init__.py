"""asyncio: :class:`AsyncConsumer` for ``async def`` handlers, the async broker adapters,
async batching (:class:`AsyncFlusher` and its siblings), :class:`AsyncVersionGuard` and
:class:`AsyncDeadLetters`.

The async path is a second driver of the same runtime parts as
:class:`~msgpatterns.Consumer` (:mod:`msgpatterns.runtime`: the settler and
``RetryPolicy.decide``, the slots, the retry scheduler, the key gate, the batch-handler
rules, the telemetry reports, the health snapshot), with the same contract (the parity
suite runs one test body on both; ``docs/asyncio.md`` lists what differs and why), and
the same wire format in the adapters (a sync and an async adapter of one broker read
each other's messages, retries and dead letters).

The async checkers (:class:`~msgpatterns.idempotency.AsyncRedisChecker`,
:class:`~msgpatterns.idempotency.AsyncSqlChecker`,
:class:`~msgpatterns.idempotency.AsyncTransactionalSqlChecker`) live in
:mod:`msgpatterns.idempotency`; they and :class:`AsyncConsumer` are also top-level names
(``from msgpatterns import AsyncConsumer``). Every part here has ``aclose()`` and
``async with``. Adapters needing an optional client library load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgpatterns._extras import lazy_attributes
from msgpatterns.aio.admin import AsyncDeadLetters
from msgpatterns.aio.base import AsyncBroker
from msgpatterns.aio.batching import AsyncBatchExecutor, AsyncFlusher, AsyncMultipleQueueFlusher
from msgpatterns.aio.consumer import AsyncConsumer, AsyncHandler
from msgpatterns.brokers.memory.aio import AsyncInMemoryBroker

if TYPE_CHECKING:
    from msgpatterns.aio.version_guard import AsyncVersionGuard
    from msgpatterns.brokers.kafka.aio import AIOKafkaBroker, AsyncKafkaBroker
    from msgpatterns.brokers.kafka.aio_threaded import ThreadedAsyncKafkaBroker
    from msgpatterns.brokers.nats.aio import AsyncNatsJetStreamBroker
    from msgpatterns.brokers.rabbitmq.aio import AsyncRabbitMQBroker
    from msgpatterns.brokers.redis.aio import AsyncRedisStreamsBroker
    from msgpatterns.brokers.threaded import ThreadedAsyncBroker

__all__ = [
    "AIOKafkaBroker",
    "AsyncBatchExecutor",
    "AsyncBroker",
    "AsyncConsumer",
    "AsyncDeadLetters",
    "AsyncFlusher",
    "AsyncHandler",
    "AsyncInMemoryBroker",
    "AsyncKafkaBroker",
    "AsyncMultipleQueueFlusher",
    "AsyncNatsJetStreamBroker",
    "AsyncRabbitMQBroker",
    "AsyncRedisStreamsBroker",
    "AsyncVersionGuard",
    "ThreadedAsyncBroker",
    "ThreadedAsyncKafkaBroker",
]

_LAZY = {
    "AsyncRedisStreamsBroker": "msgpatterns.brokers.redis.aio",
    "AsyncRabbitMQBroker": "msgpatterns.brokers.rabbitmq.aio",
    "AsyncNatsJetStreamBroker": "msgpatterns.brokers.nats.aio",
    "AsyncKafkaBroker": "msgpatterns.brokers.kafka.aio",
    "ThreadedAsyncKafkaBroker": "msgpatterns.brokers.kafka.aio_threaded",
    "AIOKafkaBroker": "msgpatterns.brokers.kafka.aio",
    "ThreadedAsyncBroker": "msgpatterns.brokers.threaded",
    "AsyncVersionGuard": "msgpatterns.aio.version_guard",
}


__getattr__ = lazy_attributes(__name__, _LAZY)
