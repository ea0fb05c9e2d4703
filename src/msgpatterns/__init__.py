"""msgpatterns: reliable message consumers with exactly-once effects.

Import the public names from here. Parts that need an optional dependency (Redis,
SQLAlchemy, ...) are loaded on first use and raise
:class:`~msgpatterns.errors.MissingExtra` naming the extra to install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgpatterns._extras import lazy_attributes
from msgpatterns.brokers.memory import InMemoryBroker
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
    from msgpatterns.batching import BatchExecutor, Flusher, Group, MultipleQueueFlusher
    from msgpatterns.idempotency import (
        MemoryChecker,
        RedisChecker,
        SqlChecker,
        TransactionalSqlChecker,
        idempotent,
    )
    from msgpatterns.ordering import OrderedExecutor, VersionGuard, optimistic_update

__version__ = "0.1.0"

__all__ = [
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
