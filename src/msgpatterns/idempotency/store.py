"""Idempotency stores: the few I/O operations the guard needs, nothing else.

A *lease store* (memory, Redis, SQL) keeps each key's record and answers three batch
operations, each one round trip, atomic per key:

* ``claim_many(requests)`` - per request (distinct keys): insert ``PROCESSING`` with
  the request's token and fingerprint when the key is absent or its record expired;
  return every key's record as it stands afterwards;
* ``complete_many(items)`` - per item: ``PROCESSING`` -> ``DONE`` (for the ttl, with
  the item's result text) if the token still owns the key, or a new DONE record if
  the key is gone; True also when it is DONE by that token already; False when another
  owner holds it;
* ``release_many(items)`` - per item: delete the ``PROCESSING`` record the token owns;
  True when deleted.

A *transaction store* (:class:`TxStore`, SQL) opens a transaction with the claim in
it (``begin``), tells whether it can still commit (``aborted``: a read inside it),
writes results into it and commits or ends it.

Stores decide nothing: the rules live in :mod:`msgpatterns.idempotency.guard`, once,
and a sync or async driver performs what they ask. Async stores have the same
operations as coroutines; :class:`AsyncAdapter` lends a sync store's operations to
the async driver (run inline for memory, through SQLAlchemy's greenlet bridge for an
``AsyncEngine``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from msgpatterns.idempotency.guard import ClaimRequest
from msgpatterns.idempotency.records import Record

__all__ = ["AsyncAdapter", "AsyncStore", "Store", "TxStore"]

T = TypeVar("T")


class Store(Protocol):
    """A lease store, sync."""

    #: Errors worth retrying (connection lost, timeout, lock wait...).
    transient: tuple[type[BaseException], ...]

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Record]: ...

    def complete_many(self, items: Sequence[ClaimRequest]) -> list[bool]: ...

    def release_many(self, items: Sequence[ClaimRequest]) -> list[bool]: ...


class AsyncStore(Protocol):
    """A lease store, async: the operations of :class:`Store`, awaited."""

    transient: tuple[type[BaseException], ...]

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Record]: ...

    async def complete_many(self, items: Sequence[ClaimRequest]) -> list[bool]: ...

    async def release_many(self, items: Sequence[ClaimRequest]) -> list[bool]: ...


class TxStore(Protocol):
    """A transaction store, sync: the transactional strategy's operations. ``tx`` is
    the store's handle of one open transaction (what the handler receives)."""

    transient: tuple[type[BaseException], ...]

    def begin(self, requests: Sequence[ClaimRequest]) -> tuple[Any, list[Record]]: ...

    def aborted(self, arg: tuple[Any, Any]) -> bool: ...

    def store_results(self, arg: tuple[Any, Sequence[ClaimRequest]]) -> list[bool]: ...

    def commit(self, tx: Any) -> None: ...

    def end(self, tx: Any) -> None: ...


class AsyncAdapter:
    """A sync store's operations as coroutines: ``run(operation, arg)`` performs each
    one (inline, or in SQLAlchemy's ``greenlet_spawn`` for a store on an
    ``AsyncEngine``'s sync facade, whose statements are then awaited on the loop)."""

    def __init__(self, store: Any, run: Callable[..., Awaitable[Any]] | None = None) -> None:
        self.store = store
        self.transient: tuple[type[BaseException], ...] = store.transient
        self._run = run

    def __getattr__(self, name: str) -> Callable[[Any], Awaitable[Any]]:
        operation = getattr(self.store, name)
        run = self._run

        async def perform(arg: Any) -> Any:
            if run is None:
                return operation(arg)
            return await run(operation, arg)

        perform.__name__ = name
        setattr(self, name, perform)  # built once per operation
        return perform
