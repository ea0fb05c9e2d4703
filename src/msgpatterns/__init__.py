"""msgpatterns: reliable message consumers with exactly-once effects.

Import the public names from here. Parts that need an optional dependency (Redis,
SQLAlchemy, ...) are loaded on first use and raise
:class:`~msgpatterns.errors.MissingExtra` naming the extra to install.

The two drivers sit side by side: :class:`Consumer` for plain handlers and
:class:`AsyncConsumer` for ``async def`` handlers, with the async checkers
(:class:`AsyncRedisChecker`, :class:`AsyncSqlChecker`,
:class:`AsyncTransactionalSqlChecker`; :class:`MemoryChecker` serves both). The async
parts load on first use, so ``import msgpatterns`` stays light; the async brokers and
batching live in :mod:`msgpatterns.aio`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgpatterns._extras import lazy_attributes
from msgpatterns.brokers.memory.broker import InMemoryBroker
from msgpatterns.consumer import Consumer
from msgpatterns.deadletter import DeadLetter
from msgpatterns.errors import (
    IdempotencyConflict,
    InProgress,
    MalformedMessage,
    NeedRetry,
    PartialFailure,
    Reject,
)
from msgpatterns.message import Message
from msgpatterns.retry import Backoff, RetryPolicy
from msgpatterns.timer import TimingWheel

if TYPE_CHECKING:
    from msgpatterns.aio.consumer import AsyncConsumer
    from msgpatterns.batching import BatchExecutor, Flusher, Group, MultipleQueueFlusher
    from msgpatterns.idempotency import (
        AsyncRedisChecker,
        AsyncSqlChecker,
        AsyncTransactionalSqlChecker,
        MemoryChecker,
        RedisChecker,
        SqlChecker,
        TransactionalSqlChecker,
        idempotent,
    )
    from msgpatterns.ordering import OrderedExecutor, VersionGuard, optimistic_update

__version__ = "0.1.0"

__all__ = [
    "AsyncConsumer",
    "AsyncRedisChecker",
    "AsyncSqlChecker",
    "AsyncTransactionalSqlChecker",
    "Backoff",
    "BatchExecutor",
    "Consumer",
    "DeadLetter",
    "Flusher",
    "Group",
    "IdempotencyConflict",
    "InMemoryBroker",
    "InProgress",
    "MalformedMessage",
    "MemoryChecker",
    "Message",
    "MultipleQueueFlusher",
    "NeedRetry",
    "OrderedExecutor",
    "PartialFailure",
    "RedisChecker",
    "Reject",
    "RetryPolicy",
    "SqlChecker",
    "TimingWheel",
    "TransactionalSqlChecker",
    "VersionGuard",
    "idempotent",
    "optimistic_update",
]

_LAZY = {
    "AsyncConsumer": "msgpatterns.aio.consumer",
    "AsyncRedisChecker": "msgpatterns.idempotency",
    "AsyncSqlChecker": "msgpatterns.idempotency",
    "AsyncTransactionalSqlChecker": "msgpatterns.idempotency",
    "idempotent": "msgpatterns.idempotency",
    "MemoryChecker": "msgpatterns.idempotency",
    "RedisChecker": "msgpatterns.idempotency",
    "SqlChecker": "msgpatterns.idempotency",
    "TransactionalSqlChecker": "msgpatterns.idempotency",
    "VersionGuard": "msgpatterns.ordering",
    "optimistic_update": "msgpatterns.ordering",
    "OrderedExecutor": "msgpatterns.ordering",
    "BatchExecutor": "msgpatterns.batching",
    "Flusher": "msgpatterns.batching",
    "MultipleQueueFlusher": "msgpatterns.batching",
    "Group": "msgpatterns.batching",
}


__getattr__ = lazy_attributes(__name__, _LAZY)
