"""Idempotency: a message handled twice acts once.

``@idempotent(checker)`` wraps a handler; the checker keeps each key's state (absent,
PROCESSING with an owner token and a lease, DONE for ``ttl``) in memory, Redis or a
SQL table. :class:`TransactionalSqlChecker` commits the dedup row together with the
handler's own writes (exactly-once effects); the lease-based checkers give
at-least-once effects across crashes and exactly-once otherwise. See
``docs/idempotency.md``.

Redis and SQL checkers are imported on first use, so ``import msgpatterns`` needs
neither redis nor SQLAlchemy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgpatterns._extras import lazy_attributes
from msgpatterns.idempotency.base import Checker, CheckerClosed, Executed, LeaseChecker
from msgpatterns.idempotency.decorator import MissingIdempotencyKey, idempotent
from msgpatterns.idempotency.fingerprint import fingerprint_of
from msgpatterns.idempotency.keys import KeyBuilder
from msgpatterns.idempotency.memory import MemoryChecker
from msgpatterns.idempotency.policy import StorePolicy
from msgpatterns.idempotency.records import Claim, IdempotencyStats, Status
from msgpatterns.idempotency.results import ResultNotSerialisable, ResultNotStored
from msgpatterns.idempotency.spec import CheckerSpec, checker_from_spec, checker_from_url

if TYPE_CHECKING:
    from msgpatterns.idempotency.redis_store import RedisChecker
    from msgpatterns.idempotency.sql import SqlChecker
    from msgpatterns.idempotency.transactional import (
        TransactionAborted,
        TransactionalSqlChecker,
    )

__all__ = [
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
    "RedisChecker": "msgpatterns.idempotency.redis_store",
    "SqlChecker": "msgpatterns.idempotency.sql",
    "TransactionalSqlChecker": "msgpatterns.idempotency.transactional",
    "TransactionAborted": "msgpatterns.idempotency.transactional",
}


__getattr__ = lazy_attributes(__name__, _LAZY)
