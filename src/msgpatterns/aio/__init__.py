"""asyncio: :class:`AsyncConsumer` for ``async def`` handlers, async broker adapters,
async batching (:class:`AsyncFlusher` and its siblings) and :class:`AsyncVersionGuard`.

The async path is a second driver of the same core as :class:`~msgpatterns.Consumer`:
the same :class:`~msgpatterns.Message`, the same decision
(:func:`msgpatterns.settlement.settle`), the same wire format in the adapters (a sync
and an async adapter of one broker read each other's messages, retries and dead
letters). Adapters needing an optional client library load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgpatterns.aio.admin import AsyncDeadLetters
from msgpatterns.aio.base import AsyncBroker
from msgpatterns.aio.batching import AsyncBatchExecutor, AsyncFlusher, AsyncMultipleQueueFlusher
from msgpatterns.aio.consumer import AsyncConsumer, AsyncHandler
from msgpatterns.aio.memory import AsyncInMemoryBroker

if TYPE_CHECKING:
    from msgpatterns.aio.kafka import ThreadedAsyncKafkaBroker
    from msgpatterns.aio.kafka_native import AIOKafkaBroker, AsyncKafkaBroker
    from msgpatterns.aio.rabbitmq import AsyncRabbitMQBroker
    from msgpatterns.aio.redis_streams import AsyncRedisStreamsBroker
    from msgpatterns.aio.threaded import ThreadedAsyncBroker
    from msgpatterns.aio.version_guard import AsyncVersionGuard

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
    "AsyncRabbitMQBroker",
    "AsyncRedisStreamsBroker",
    "AsyncVersionGuard",
    "ThreadedAsyncBroker",
    "ThreadedAsyncKafkaBroker",
]

_LAZY = {
    "AsyncRedisStreamsBroker": "msgpatterns.aio.redis_streams",
    "AsyncRabbitMQBroker": "msgpatterns.aio.rabbitmq",
    "AsyncKafkaBroker": "msgpatterns.aio.kafka_native",
    "ThreadedAsyncKafkaBroker": "msgpatterns.aio.kafka",
    "AIOKafkaBroker": "msgpatterns.aio.kafka_native",
    "ThreadedAsyncBroker": "msgpatterns.aio.threaded",
    "AsyncVersionGuard": "msgpatterns.aio.version_guard",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is not None:
        import importlib

        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
