"""The store steps of batch claims: what a runtime that claims many messages at once
(:class:`~msgpatterns.idempotency.batch.BatchGuard`, behind the consumers' batch
claims) needs of a lease checker.

Three steps, each one store round trip for many keys, each one of the six rules:

* ``claim_stored`` - rule 1 for keys already built (``store_key``); raises
  :class:`~msgpatterns.errors.StoreUnavailable` when the store stays unreachable (rule
  6 is the caller's);
* ``complete_ran`` - rule 2 for handlers that returned (or queued behind with
  ``write_behind``); a store that stays unreachable is logged, never raised: the
  effects happened, the leases expire;
* ``release_failed`` - rule 3 for handlers that raised; a store that stays
  unreachable is logged: the keys free themselves when their leases expire.

:class:`BatchStore` is the sync form (:class:`~msgpatterns.idempotency.LeaseChecker`:
MemoryChecker, RedisChecker, SqlChecker), :class:`AsyncBatchStore` the awaited form
(:class:`~msgpatterns.idempotency.AsyncLeaseChecker`: AsyncRedisChecker,
AsyncSqlChecker). A checker with neither (TransactionalSqlChecker, whose claim lives
in the handler's own transaction, or a custom :class:`~msgpatterns.idempotency.Checker`)
keeps one claim per message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from msgpatterns.idempotency.policy import StorePolicy
from msgpatterns.idempotency.records import Claim, IdempotencyStats

__all__ = ["AsyncBatchStore", "BatchStore", "StoreTerms"]


@runtime_checkable
class StoreTerms(Protocol):
    """What both forms share: the lease, the policy for an unreachable store, the
    counters and the key that signs stored results."""

    #: Seconds a claim holds its key (a batch claim is sized to stay well within it).
    lease: float
    #: Retries of an unreachable store, and the NeedRetry delay after them (rule 6).
    policy: StorePolicy
    #: The checker's counters.
    stats: IdempotencyStats

    @property
    def result_key(self) -> bytes | None:
        """The key stored results are signed with (None: unsigned)."""


@runtime_checkable
class BatchStore(StoreTerms, Protocol):
    """The batch store steps of a sync lease checker (see the module docstring)."""

    def claim_stored(self, store_keys: Sequence[str],
                     fingerprints: Sequence[str | None]) -> list[Claim]:
        """Rule 1 for many built keys, one round trip; one claim per key, in order."""

    def complete_ran(self, claims: Sequence[Claim]) -> None:
        """Rule 2 for many handlers that returned, one round trip; never raises for an
        unreachable store."""

    def release_failed(self, claims: Sequence[Claim]) -> None:
        """Rule 3 for many handlers that raised, one round trip; never raises for an
        unreachable store."""


@runtime_checkable
class AsyncBatchStore(StoreTerms, Protocol):
    """The batch store steps of an async lease checker: :class:`BatchStore`'s,
    awaited."""

    async def aclaim_stored(self, store_keys: Sequence[str],
                            fingerprints: Sequence[str | None]) -> list[Claim]:
        """:meth:`BatchStore.claim_stored`, awaited."""

    async def acomplete_ran(self, claims: Sequence[Claim]) -> None:
        """:meth:`BatchStore.complete_ran`, awaited."""

    async def arelease_failed(self, claims: Sequence[Claim]) -> None:
        """:meth:`BatchStore.release_failed`, awaited."""
