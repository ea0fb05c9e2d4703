"""TransactionalSqlChecker: the dedup row and the handler's writes in one transaction.

This is the exactly-once path. The handler receives the open connection as ``tx``
and does its business writes through it; the dedup row is inserted in the same
transaction first. Commit makes both durable, any error rolls both back, and a crash
at any point leaves both or neither: a redelivered message either finds the key DONE
(skipped) or finds nothing and is applied - once.

A concurrent duplicate's insert blocks on the unique key until the first transaction
ends, then sees the row DONE (skipped) or absent (applied, if the first rolled back).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

from msgpatterns.errors import ConfigurationError, NeedRetry, StoreUnavailable, seconds
from msgpatterns.idempotency.base import (
    ClaimRequest,
    Executed,
    claim_batch,
    count_claims,
    skip_or_raise,
    unavailable,
)
from msgpatterns.idempotency.keys import KeyBuilder
from msgpatterns.idempotency.policy import StorePolicy, call_with_retries
from msgpatterns.idempotency.records import DONE, Claim, IdempotencyStats, Record
from msgpatterns.idempotency.spec import CheckerSpec, policy_options
from msgpatterns.idempotency.sql import SqlMaintenance, SqlStore

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection, Engine, RootTransaction

__all__ = ["TransactionalSqlChecker"]

log = logging.getLogger("msgpatterns.idempotency")

R = TypeVar("R")


class TransactionalSqlChecker(SqlMaintenance):
    """Exactly-once effects for handlers whose effects are writes to the same database.

    Decorate a handler that takes ``tx``::

        checker = TransactionalSqlChecker("sqlite:///app.db")

        @idempotent(checker)
        def handle(message, tx):
            tx.execute(orders.insert().values(id=message.key, total=message.body["total"]))

    ``tx`` is the SQLAlchemy ``Connection`` of the open transaction: write through it,
    and neither commit nor roll it back (the checker does). Effects outside this
    database (HTTP calls, other stores) are not covered.

    Args:
        engine_or_url: an SQLAlchemy ``Engine`` or URL; the handler's tables live here.
        table: the dedup table (same layout as :class:`SqlChecker`'s; both may share it).
        ttl: seconds a DONE key is remembered (then purgeable).
        namespace: first part of every key (``namespace:group:key``).
        policy: retries and the NeedRetry delay when the database is unreachable or a
            lock wait times out.
        clock: seconds since the epoch (default ``time.time``).

    There is no lease: an uncommitted claim is invisible and dies with its
    transaction. ``complete`` and ``release`` are the commit and rollback of ``tx``.
    """

    def __init__(
        self,
        engine_or_url: Engine | str,
        table: str = "msgpatterns_dedup",
        ttl: float | timedelta = 86400,
        *,
        namespace: str = "msgpatterns",
        policy: StorePolicy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from msgpatterns.idempotency.sql_table import KEY_BYTES

        self.store = SqlStore(engine_or_url, table, clock, autocommit=False)
        self.engine = self.store.engine
        self.ttl = seconds(ttl) or 0.0
        if self.ttl <= 0:
            raise ConfigurationError("ttl must be positive")
        self.namespace = namespace
        self.keys = KeyBuilder(namespace, KEY_BYTES)
        self.policy = policy if policy is not None else StorePolicy()
        self.stats = IdempotencyStats()
        self.transient = self.store.transient
        self._ttl_ms = int(self.ttl * 1000)

    #: The decorated handler receives the open transaction as ``tx``.
    passes_tx = True

    def store_key(self, key: object, group: str = "") -> str:
        return self.keys.build(key, group)

    # -- inside a caller's transaction ------------------------------------------------------

    def _claim_in(self, tx: Connection, requests: Sequence[ClaimRequest]) -> list[Record]:
        self.store.table.create()
        now = self.store.now_ms()
        rows = [{"dedup_key": r.key, "state": DONE, "owner_token": r.token,
                 "fingerprint": r.fingerprint, "expires_at": now + self._ttl_ms,
                 "updated_at": now} for r in requests]
        found = self.store.table.claim(tx, rows, now, lock=True)
        return [found[r.key] for r in requests]

    def claim(self, key: object, *, group: str = "", fingerprint: str | None = None,
              tx: Connection | None = None) -> Claim:
        """Claim ``key`` inside ``tx`` (required): committing ``tx`` completes it."""
        return self.claim_many([key], group=group,
                               fingerprints=None if fingerprint is None else [fingerprint],
                               tx=tx)[0]

    def claim_many(
        self, keys: Sequence[object], *, group: str = "",
        fingerprints: Sequence[str | None] | None = None, tx: Connection | None = None,
    ) -> list[Claim]:
        """Claim many keys inside ``tx`` (required) with one statement; committing
        ``tx`` completes the claimed ones, rolling it back releases them.

        Not retried: a failure aborts the caller's transaction, which the caller
        retries as a whole.
        """
        if tx is None:
            raise ConfigurationError(
                "TransactionalSqlChecker claims inside a transaction: pass tx=<Connection>"
            )
        claims = claim_batch(self.keys.build_many(keys, group), fingerprints,
                             lambda batch: self._claim_in(tx, batch), 0.0)
        count_claims(self.stats, claims)
        return claims

    def complete(self, claim: Claim) -> bool:
        """Nothing to do: committing the claim's transaction completes it. True."""
        return True

    def complete_many(self, claims: Sequence[Claim]) -> list[bool]:
        """Nothing to do: committing the claims' transaction completes them."""
        return [True] * len(claims)

    def release(self, claim: Claim) -> bool:
        """Nothing to do: rolling the claim's transaction back releases it. True."""
        return True

    def release_many(self, claims: Sequence[Claim]) -> list[bool]:
        """Nothing to do: rolling the claims' transaction back releases them."""
        return [True] * len(claims)

    # -- the guarded call -------------------------------------------------------------------

    def _begin(self, store_key: str, fingerprint: str | None,
               ) -> tuple[Connection, RootTransaction, Claim]:
        conn = self.engine.connect()
        try:
            tx = conn.begin()
            claims = claim_batch([store_key], [fingerprint],
                                 lambda batch: self._claim_in(conn, batch), 0.0)
        except BaseException:
            conn.close()
            raise
        return conn, tx, claims[0]

    def execute(
        self, key: object, call: Callable[[Any], R], *, group: str = "",
        fingerprint: str | None = None, fail_open: bool = False,
    ) -> Executed[R]:
        """Run ``call(tx)`` and commit it with the dedup row, unless the key is DONE.

        Raises :class:`InProgress` when a lease-based checker sharing the table holds
        the key, :class:`IdempotencyConflict` on a fingerprint mismatch,
        :class:`NeedRetry` when the database is unreachable or the commit's outcome is
        unknown (a redelivery then finds it DONE or absent), and whatever ``call``
        raises (after rolling everything back).
        """
        if fail_open:
            raise ConfigurationError(
                "fail_open makes no sense with TransactionalSqlChecker: the dedup row "
                "and the handler's writes live in the same database"
            )
        store_key = self.keys.build(key, group)
        try:
            conn, tx, claim = call_with_retries(
                lambda: self._begin(store_key, fingerprint), self.policy, self.transient,
                what="TransactionalSqlChecker.claim",
                on_error=lambda _: self.stats.add("store_errors"),
            )
        except StoreUnavailable as exc:
            return unavailable(self, store_key, call, exc, fail_open=False,
                               delay=self.policy.unavailable_delay)
        try:
            count_claims(self.stats, (claim,))
            if claim.token is None:
                tx.rollback()
                return skip_or_raise(self, claim)
            try:
                result = call(conn)
            except BaseException:
                self.stats.add("released")
                raise  # closing the connection below rolls back both
            try:
                tx.commit()
            except self.transient as exc:
                conn.invalidate()  # never reuse a connection whose commit is in doubt
                self.stats.add("unavailable")
                raise NeedRetry(
                    delay=self.policy.unavailable_delay,
                    reason=f"commit of {store_key!r} failed, outcome unknown: {exc!r}",
                ) from exc
        finally:
            conn.close()
        self.stats.add("completed")
        return Executed(True, result, claim)

    def spec(self) -> CheckerSpec:
        """The URL and options that rebuild this checker in another process."""
        return CheckerSpec("transactional_sql", self.store.url(), {
            "table": self.store.table.name, "ttl": self.ttl, "namespace": self.namespace,
            "policy": policy_options(self.policy),
        })

    def close(self) -> None:
        """Dispose of the engine if this checker created it."""
        self.store.close()

    def __repr__(self) -> str:
        return (f"TransactionalSqlChecker(table={self.store.table.name!r}, "
                f"namespace={self.namespace!r}, ttl={self.ttl:g})")
