"""Idempotency: a message handled twice acts once.

``@idempotent(checker)`` wraps a handler; the checker keeps each key's state (absent,
PROCESSING with an owner token and a lease, DONE for ``ttl``) in memory, Redis or a
SQL table. :class:`TransactionalSqlChecker` commits the dedup row together with the
handler's own writes (exactly-once effects); the lease-based checkers give
at-least-once effects across crashes and exactly-once otherwise. See
``docs/idempotency.md``.

``async def`` handlers take the async checkers - :class:`AsyncRedisChecker`
(``redis.asyncio``), :class:`AsyncSqlChecker` and :class:`AsyncTransactionalSqlChecker`
(SQLAlchemy ``AsyncEngine``) - or :class:`MemoryChecker`: the same ``@idempotent``, the
same rules (one guard, :mod:`msgpatterns.idempotency.guard`), only the I/O awaited.

Redis and SQL checkers are imported on first use, so ``import msgpatterns`` needs
neither redis nor SQLAlchemy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgpatterns._extras import lazy_attributes
from msgpatterns.idempotency.base import (
    AsyncChecker,
    AsyncLeaseChecker,
    BatchChecker,
    Checker,
    CheckerClosed,
    Executed,
    LeaseChecker,
)
from msgpatterns.idempotency.decorator import MissingIdempotencyKey, idempotent
from msgpatterns.idempotency.fingerprint import fingerprint_of
from msgpatterns.idempotency.keys import KeyBuilder
from msgpatterns.idempotency.memory import MemoryChecker
from msgpatterns.idempotency.policy import StorePolicy
from msgpatterns.idempotency.records import Claim, IdempotencyStats, Status
from msgpatterns.idempotency.results import (
    ResultIntegrityError,
    ResultNotSerialisable,
    ResultNotStored,
)
from msgpatterns.idempotency.spec import CheckerSpec, checker_from_spec, checker_from_url

if TYPE_CHECKING:
    from msgpatterns.idempotency.redis_store import AsyncRedisChecker, RedisChecker
    from msgpatterns.idempotency.sql import AsyncSqlChecker, SqlChecker
    from msgpatterns.idempotency.transactional import (
        AsyncTransactionalSqlChecker,
        TransactionAborted,
        TransactionalSqlChecker,
    )

__all__ = [
    "AsyncChecker",
    "AsyncLeaseChecker",
    "AsyncRedisChecker",
    "AsyncSqlChecker",
    "AsyncTransactionalSqlChecker",
    "BatchChecker",
    "Checker",
    "CheckerClosed",
    "CheckerSpec",
    "Claim",
    "Executed",
    "IdempotencyStats",
    "KeyBuilder",
    "LeaseChecker",
    "MemoryChecker",
    "MissingIdempotencyKey",
    "RedisChecker",
    "ResultIntegrityError",
    "ResultNotSerialisable",
    "ResultNotStored",
    "SqlChecker",
    "Status",
    "StorePolicy",
    "TransactionAborted",
    "TransactionalSqlChecker",
    "checker_from_spec",
    "checker_from_url",
    "fingerprint_of",
    "idempotent",
]

_LAZY = {
    "AsyncRedisChecker": "msgpatterns.idempotency.redis_store",
    "AsyncSqlChecker": "msgpatterns.idempotency.sql",
    "AsyncTransactionalSqlChecker": "msgpatterns.idempotency.transactional",
    "RedisChecker": "msgpatterns.idempotency.redis_store",
    "SqlChecker": "msgpatterns.idempotency.sql",
    "TransactionalSqlChecker": "msgpatterns.idempotency.transactional",
    "TransactionAborted": "msgpatterns.idempotency.transactional",
}


__getattr__ = lazy_attributes(__name__, _LAZY)
