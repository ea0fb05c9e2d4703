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

from msgpatterns._callables import renamed_arguments
from msgpatterns.errors import (
    ConfigurationError,
    MsgPatternsError,
    NeedRetry,
    StoreUnavailable,
    seconds,
)
from msgpatterns.idempotency.base import (
    NO_RESULT,
    ClaimRequest,
    Executed,
    attach_results,
    claim_batch,
    count_claims,
    owned_requests,
    reported_round_trip,
    skip_or_raise,
    unavailable,
    with_result,
)
from msgpatterns.idempotency.keys import KeyBuilder
from msgpatterns.idempotency.policy import StorePolicy, call_with_retries
from msgpatterns.idempotency.records import DONE, Claim, IdempotencyStats, Record
from msgpatterns.idempotency.results import DEFAULT_MAX_RESULT_BYTES, check_max_result_bytes
from msgpatterns.idempotency.spec import CheckerSpec, policy_options
from msgpatterns.idempotency.sql import SqlMaintenance, SqlStore

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection, Engine, RootTransaction

__all__ = ["TransactionAborted", "TransactionalSqlChecker"]

log = logging.getLogger("msgpatterns.idempotency")

R = TypeVar("R")

#: The driver-reported "in a failed transaction" status (psycopg2's
#: TRANSACTION_STATUS_INERROR, psycopg 3's TransactionStatus.INERROR).
_IN_ERROR = 3


class TransactionAborted(MsgPatternsError):
    """The database aborted the handler's transaction before commit: nothing of it (nor
    the dedup row) was committed. An ordinary failure: the message is retried per the
    retry policy, never acked."""


def _driver_says_aborted(conn: Connection) -> bool | None:
    """Whether the driver reports the transaction as failed, without a round trip:
    True/False for psycopg2 and psycopg 3, None when the driver does not say."""
    dbapi_conn: Any = conn.connection.dbapi_connection
    status = getattr(dbapi_conn, "get_transaction_status", None)  # psycopg2
    if callable(status):
        return bool(status() == _IN_ERROR)
    info = getattr(dbapi_conn, "info", None)  # psycopg 3
    current = getattr(info, "transaction_status", None)
    if current is not None:
        return bool(int(current) == _IN_ERROR)
    return None


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
        url: an SQLAlchemy URL or ``Engine``; the handler's tables live here (the old
            keyword ``engine_or_url=`` still works).
        table: the dedup table (same layout as :class:`SqlChecker`'s; both may share it).
        ttl: seconds a DONE key is remembered (then purgeable).
        namespace: first part of every key (``namespace:group:key``).
        policy: retries and the NeedRetry delay when the database is unreachable or a
            lock wait times out.
        clock: seconds since the epoch (default ``time.time``).

    There is no lease: an uncommitted claim is invisible and dies with its
    transaction. ``complete`` and ``release`` are the commit and rollback of ``tx``.
    """

    @renamed_arguments(engine_or_url="url")
    def __init__(
        self,
        url: Engine | str,
        table: str = "msgpatterns_dedup",
        ttl: float | timedelta = 86400,
        *,
        namespace: str = "msgpatterns",
        policy: StorePolicy | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        from msgpatterns.idempotency.sql_table import KEY_BYTES

        self.store = SqlStore(url, table, clock, autocommit=False)
        self.engine = self.store.engine
        self.ttl = seconds(ttl) or 0.0
        if self.ttl <= 0:
            raise ConfigurationError("ttl must be positive")
        self.namespace = namespace
        self.keys = KeyBuilder(namespace, KEY_BYTES)
        self.policy = policy if policy is not None else StorePolicy()
        self.stats = IdempotencyStats()
        self.stats.owner = type(self).__name__
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
                 "fingerprint": r.fingerprint, "result": None,
                 "expires_at": now + self._ttl_ms, "updated_at": now} for r in requests]
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
        self._check_open()
        if tx is None:
            raise ConfigurationError(
                "TransactionalSqlChecker claims inside a transaction: pass tx=<Connection>"
            )
        claims = claim_batch(self.keys.build_many(keys, group), fingerprints,
                             lambda batch: self._claim_in(tx, batch), 0.0)
        count_claims(self.stats, claims)
        return claims

    def complete(self, claim: Claim, result: object = NO_RESULT, *,
                 max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
                 tx: Connection | None = None) -> bool:
        """Committing the claim's transaction completes it; with ``result`` (and the
        claim's ``tx``), the result is written with the dedup row first. True."""
        results = None if result is NO_RESULT else [result]
        return self.complete_many([claim], results, max_result_bytes=max_result_bytes,
                                  tx=tx)[0]

    def complete_many(self, claims: Sequence[Claim], results: Sequence[object] | None = None,
                      *, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
                      tx: Connection | None = None) -> list[bool]:
        """Committing the claims' transaction completes them; with ``results`` (one per
        claim, JSON-serialisable) and the claims' ``tx``, each result is written with
        its dedup row inside ``tx``, to be committed with it."""
        self._check_open()
        if results is not None:
            if tx is None:
                raise ConfigurationError(
                    "results are written inside the claims' transaction: pass tx=<Connection>")
            claimed = attach_results(claims, results, self.stats, max_result_bytes)
            self.store.table.store_results(tx, owned_requests(claimed))
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
        store_result: bool = False, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    ) -> Executed[R]:
        """Run ``call(tx)`` and commit it with the dedup row, unless the key is DONE.

        With ``store_result`` the call's result is written to the dedup row inside the
        same transaction (committed with the effect), and a duplicate's
        ``Executed.result`` is that stored value (``ResultNotStored`` if none).

        Raises :class:`InProgress` when a lease-based checker sharing the table holds
        the key, :class:`IdempotencyConflict` on a fingerprint mismatch,
        :class:`NeedRetry` when the database is unreachable or the commit's outcome is
        unknown (a redelivery then finds it DONE or absent),
        :class:`TransactionAborted` when the database aborted the transaction while
        ``call`` ran (it caught a failed statement's error: nothing is committed), and
        whatever ``call`` raises (after rolling everything back).
        """
        self._check_open()
        if store_result:
            check_max_result_bytes(max_result_bytes)
        if fail_open:
            raise ConfigurationError(
                "fail_open makes no sense with TransactionalSqlChecker: the dedup row "
                "and the handler's writes live in the same database"
            )
        store_key = self.keys.build(key, group)
        try:
            conn, tx, claim = reported_round_trip(
                self.stats.owner, "claim", lambda: call_with_retries(
                    lambda: self._begin(store_key, fingerprint), self.policy,
                    self.transient, what="TransactionalSqlChecker.claim",
                    on_error=lambda _: self.stats.add("store_errors"),
                ))
        except StoreUnavailable as exc:
            return unavailable(self, store_key, call, exc, fail_open=False,
                               delay=self.policy.unavailable_delay)
        try:
            count_claims(self.stats, (claim,))
            if claim.token is None:
                tx.rollback()
                return skip_or_raise(self, claim, store_result)
            try:
                result = call(conn)
            except BaseException:
                self.stats.add("released")
                raise  # closing the connection below rolls back both
            self._verify_intact(conn, claim)
            if store_result:
                claim = with_result(claim, result, self.stats, max_result_bytes)
                self.store.table.store_results(conn, owned_requests([claim]))
            try:
                reported_round_trip(self.stats.owner, "commit", tx.commit)
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

    def _verify_intact(self, conn: Connection, claim: Claim) -> None:
        """Raise :class:`TransactionAborted` unless the transaction can still commit the
        claim: a failed statement the handler caught aborts a PostgreSQL transaction
        (COMMIT would silently roll back), a deadlock rolls back a whole MySQL one.

        psycopg2/psycopg report the state without a round trip; elsewhere the claim's
        row is read back inside the transaction (one primary-key read).
        """
        aborted = _driver_says_aborted(conn)
        cause: BaseException | None = None
        if aborted is None:
            try:
                found = self.store.table.owner_of(conn, claim.key)
            except self.store.dbapi_errors as exc:
                aborted, cause = True, exc
            else:
                aborted = found != claim.token
        if aborted:
            self.stats.add("released")
            raise TransactionAborted(
                f"the database aborted the transaction of {claim.key!r} before commit (a "
                "statement failed inside the handler, e.g. an IntegrityError it caught): "
                "nothing was committed and the message will be retried; wrap statements "
                "whose errors the handler handles in tx.begin_nested() (a savepoint)"
            ) from cause

    def spec(self) -> CheckerSpec:
        """The URL and options that rebuild this checker in another process."""
        return CheckerSpec("transactional_sql", self.store.url(), {
            "table": self.store.table.name, "ttl": self.ttl, "namespace": self.namespace,
            "policy": policy_options(self.policy),
        })

    def close(self) -> None:
        """Dispose of the engine if this checker created it; afterwards every operation
        raises :class:`~msgpatterns.idempotency.CheckerClosed`. Idempotent."""
        if self._mark_closed():
            self.store.close()

    def __repr__(self) -> str:
        return (f"TransactionalSqlChecker({self.store.where()!r}, "
                f"table={self.store.table.name!r}, namespace={self.namespace!r}, "
                f"ttl={self.ttl:g})")
