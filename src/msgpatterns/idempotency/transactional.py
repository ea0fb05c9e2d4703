"""TransactionalSqlChecker: the dedup row and the handler's writes in one transaction.

This is the exactly-once path. The handler receives the open connection as ``tx``
and does its business writes through it; the dedup row is inserted in the same
transaction first. Commit makes both durable, any error rolls both back, and a crash
at any point leaves both or neither: a redelivered message either finds the key DONE
(skipped) or finds nothing and is applied - once.

A concurrent duplicate's insert blocks on the unique key until the first transaction
ends, then sees the row DONE (skipped) or absent (applied, if the first rolled back).

The rules are the guard's transactional strategy
(:func:`~msgpatterns.idempotency.guard.transactional_steps`); :class:`SqlTxStore` only
does the I/O. :class:`AsyncTransactionalSqlChecker` is the same for ``async def``
handlers on an ``AsyncEngine``: the same statements through SQLAlchemy's greenlet
bridge, the handler getting the transaction as an ``AsyncConnection``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Self, TypeVar, Unpack

from msgpatterns._callables import renamed_arguments
from msgpatterns.errors import ConfigurationError, StoreUnavailable, seconds
from msgpatterns.idempotency.base import (
    AsyncOptions,
    Closable,
    Executed,
    aperform_io,
    attach_results,
    checker_options,
    perform_io,
)
from msgpatterns.idempotency.guard import (
    ClaimRequest,
    Io,
    LeaseRules,
    TransactionAborted,
    adrive,
    claim_many_steps,
    drive,
    owned_requests,
    transactional_steps,
)
from msgpatterns.idempotency.keys import KeyBuilder
from msgpatterns.idempotency.policy import StorePolicy
from msgpatterns.idempotency.records import DONE, Claim, IdempotencyStats, Record
from msgpatterns.idempotency.results import DEFAULT_MAX_RESULT_BYTES, SignsResults
from msgpatterns.idempotency.spec import CheckerSpec, policy_options
from msgpatterns.idempotency.sql import SqlMaintenance, SqlStore
from msgpatterns.idempotency.store import AsyncAdapter

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection, Engine
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["AsyncTransactionalSqlChecker", "SqlTxStore", "TransactionAborted",
           "TransactionalSqlChecker"]

R = TypeVar("R")

#: The driver-reported "in a failed transaction" status (psycopg2's
#: TRANSACTION_STATUS_INERROR, psycopg 3's TransactionStatus.INERROR).
_IN_ERROR = 3


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


class SqlTxStore(SqlStore):
    """The transaction store: open a transaction with the claim inside it, tell whether
    it can still commit, write results into it, commit, end it. The handle of one
    transaction is its ``Connection``."""

    def __init__(self, engine_or_url: Engine | AsyncEngine | str, table: str,
                 clock: Callable[[], float], *, ttl: float, asynchronous: bool = False) -> None:
        super().__init__(engine_or_url, table, clock, autocommit=False,
                         asynchronous=asynchronous)
        self.ttl_ms = int(ttl * 1000)

    def claim_in(self, conn: Connection, requests: Sequence[ClaimRequest]) -> list[Record]:
        """Insert each key DONE inside ``conn``'s transaction (absent or expired keys),
        read back under lock: committed, the keys are done; rolled back, absent."""
        self.table.create()
        now = self.now_ms()
        rows = [{"dedup_key": r.key, "state": DONE, "owner_token": r.token,
                 "fingerprint": r.fingerprint, "result": None,
                 "expires_at": now + self.ttl_ms, "updated_at": now} for r in requests]
        found = self.table.claim(conn, rows, now, lock=True)
        return [found[r.key] for r in requests]

    def begin(self, requests: Sequence[ClaimRequest]) -> tuple[Connection, list[Record]]:
        conn = self.engine.connect()
        try:
            conn.begin()
            return conn, self.claim_in(conn, requests)
        except BaseException:
            conn.close()
            raise

    def aborted(self, arg: tuple[Connection, Claim]) -> bool:
        """True unless the transaction can still commit the claim: a failed statement
        the handler caught aborts a PostgreSQL transaction (COMMIT would silently roll
        back), a deadlock rolls back a whole MySQL one. psycopg reports the state
        without a round trip; elsewhere the claim's row is read back inside it."""
        conn, claim = arg
        aborted = _driver_says_aborted(conn)
        if aborted is not None:
            return aborted
        try:
            return self.table.owner_of(conn, claim.key) != claim.token
        except self.dbapi_errors:
            return True

    def store_results(self, arg: tuple[Connection, Sequence[ClaimRequest]]) -> list[bool]:
        conn, items = arg
        return self.table.store_results(conn, items)

    def commit(self, conn: Connection) -> None:
        """Commit; a transient failure means the outcome is unknown:
        :class:`StoreUnavailable`, and the connection is never reused."""
        try:
            conn.commit()
        except self.transient as exc:
            conn.invalidate()
            raise StoreUnavailable(f"commit failed, outcome unknown: {exc!r}") from exc

    def end(self, conn: Connection) -> None:
        """Close the connection: rolls back whatever was not committed."""
        try:
            conn.close()
        except self.dbapi_errors:
            conn.invalidate()


class _TransactionalBase(Closable, SignsResults):
    """What both transactional checkers hold."""

    #: The decorated handler receives the open transaction as ``tx``.
    passes_tx = True
    store: SqlTxStore

    def __init__(self, store: SqlTxStore, ttl: float, namespace: str,
                 policy: StorePolicy | None) -> None:
        from msgpatterns.idempotency.sql_table import KEY_BYTES

        self.store = store
        self.ttl = ttl
        if self.ttl <= 0:
            raise ConfigurationError("ttl must be positive")
        self.namespace = namespace
        self.keys = KeyBuilder(namespace, KEY_BYTES)
        self.policy = policy if policy is not None else StorePolicy()
        self.stats = IdempotencyStats()
        self.stats.owner = type(self).__name__
        self.transient = self.store.transient

    def store_key(self, key: object, group: str = "") -> str:
        return self.keys.build(key, group)

    def _steps(self, key: object, group: str, fingerprint: str | None, fail_open: bool,
               store_result: bool, max_result_bytes: int) -> Any:
        self._check_open()
        options = checker_options(fail_open, store_result, max_result_bytes, self.result_key)
        if fail_open:
            raise ConfigurationError(
                "fail_open makes no sense with TransactionalSqlChecker: the dedup row "
                "and the handler's writes live in the same database"
            )
        return transactional_steps(self.stats, self.keys.build(key, group), fingerprint,
                                   options, self.policy.unavailable_delay)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.store.where()!r}, "
                f"table={self.store.table.name!r}, namespace={self.namespace!r}, "
                f"ttl={self.ttl:g})")


class TransactionalSqlChecker(SqlMaintenance, _TransactionalBase):
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
    transaction. Nothing is completed or released after the fact: the commit of ``tx``
    completes the key, a rollback releases it. For ``async def`` handlers use
    :class:`AsyncTransactionalSqlChecker`.
    """

    store: SqlTxStore

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
        ttl_s = seconds(ttl) or 0.0
        super().__init__(SqlTxStore(url, table, clock, ttl=ttl_s), ttl_s,
                         namespace, policy)
        self.engine = self.store.engine

    def _perform(self, io: Io) -> Any:
        if io.op == "begin":  # a transaction begun before close() runs to its end
            self._check_open()
        return perform_io(getattr(self.store, io.op), io, self.policy, self.transient,
                          self.stats)

    # -- inside a caller's transaction ------------------------------------------------------

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
        # no lease: a key held by this very batch is in progress as long as its transaction
        rules = LeaseRules(self.keys, self.stats, 0.0, self.policy.unavailable_delay)
        return drive(claim_many_steps(rules, self.keys.build_many(keys, group), fingerprints),
                     lambda io: self.store.claim_in(tx, io.arg), _no_run)

    def complete_many(self, claims: Sequence[Claim], results: Sequence[object] | None = None,
                      *, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
                      tx: Connection | None = None) -> list[bool]:
        """Write each claim's result (``results``, one per claim, JSON) to its dedup
        row inside ``tx``, the claims' transaction, to be committed with it; True per
        claim whose row took it. Committing ``tx`` is what completes the claims: without
        ``results`` there is nothing to write (True per claim)."""
        self._check_open()
        if results is None:
            return [True] * len(claims)
        owned = owned_requests(attach_results(claims, results, self.stats, max_result_bytes,
                                              self.result_key))
        if tx is None:
            raise ConfigurationError(
                "results are written inside the claims' transaction: pass tx=<Connection>")
        return self.store.table.store_results(tx, owned)

    # -- the guarded call -------------------------------------------------------------------

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
        steps = self._steps(key, group, fingerprint, fail_open, store_result,
                            max_result_bytes)
        result: Executed[R] = drive(steps, self._perform, call)
        return result

    def spec(self) -> CheckerSpec:
        """The URL and options that rebuild this checker in another process."""
        return CheckerSpec("transactional_sql", self.store.url(), {
            "table": self.store.table.name, "ttl": self.ttl, "namespace": self.namespace,
            "policy": policy_options(self.policy),
        })

    def close(self) -> None:
        """Dispose of the engine if this checker created it; afterwards every operation
        raises :class:`~msgpatterns.errors.CheckerClosed`. Idempotent. A call whose
        transaction began before (in another thread) runs to its end on the connection
        it holds: it commits, or rolls back, and gives the connection back."""
        if self._mark_closed():
            self.store.close()

    def __enter__(self) -> Self:
        """``with checker:`` - the block's end calls :meth:`close`."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncTransactionalSqlChecker(_TransactionalBase):
    """:class:`TransactionalSqlChecker` for ``async def`` handlers, on an ``AsyncEngine``.

    Decorate a handler that takes ``tx``, an ``AsyncConnection`` in the open
    transaction::

        checker = AsyncTransactionalSqlChecker("postgresql+psycopg://app@db/app")

        @idempotent(checker)
        async def handle(message, tx):
            await tx.execute(orders.insert().values(id=message.key))

    The same table, statements and rules as TransactionalSqlChecker (the two share a
    table): the dedup row and the handler's writes commit together, a crash or a
    cancelled task before the commit leaves neither. Drivers: ``postgresql+psycopg``,
    ``sqlite+aiosqlite``, ``mysql+aiomysql``. Options as for TransactionalSqlChecker
    (``ttl``, ``namespace``, ``policy``, ``clock``; keyword-only). Close with
    ``await checker.aclose()``.
    """

    @renamed_arguments(engine_or_url="url")
    def __init__(self, url: AsyncEngine | str, table: str = "msgpatterns_dedup",
                 **options: Unpack[AsyncOptions]) -> None:
        if "lease" in options or "write_behind" in options:
            raise ConfigurationError("AsyncTransactionalSqlChecker has no lease and no "
                                     "write_behind: the commit completes the key")
        ttl = seconds(options.get("ttl", 86400)) or 0.0
        store = SqlTxStore(url, table, options.get("clock", time.time), ttl=ttl,
                           asynchronous=True)
        super().__init__(store, ttl, options.get("namespace", "msgpatterns"),
                         options.get("policy"))
        assert self.store.async_engine is not None
        self.engine: AsyncEngine = self.store.async_engine
        self._astore = AsyncAdapter(self.store, self.store.in_greenlet)

    async def _aperform(self, io: Io) -> Any:
        if io.op == "begin":  # a transaction begun before aclose() runs to its end
            self._check_open()
        return await aperform_io(getattr(self._astore, io.op), io, self.policy,
                                 self.transient, self.stats)

    async def aexecute(
        self, key: object, call: Callable[[Any], Awaitable[R]], *, group: str = "",
        fingerprint: str | None = None, fail_open: bool = False,
        store_result: bool = False, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    ) -> Executed[R]:
        """:meth:`TransactionalSqlChecker.execute` for an ``async def`` handler:
        ``await call(tx)`` with ``tx`` an ``AsyncConnection`` in the open transaction;
        the same outcomes and errors. A handler cancelled while it runs rolls back."""
        from sqlalchemy.ext.asyncio import AsyncConnection

        steps = self._steps(key, group, fingerprint, fail_open, store_result,
                            max_result_bytes)
        engine = self.engine

        def run(conn: Connection) -> Awaitable[R]:
            return call(AsyncConnection(engine, conn))

        result: Executed[R] = await adrive(steps, self._aperform, run)
        return result

    async def aclose(self) -> None:
        """Dispose of the engine if this checker created it; afterwards every operation
        raises :class:`~msgpatterns.errors.CheckerClosed`. Idempotent."""
        if self._mark_closed():
            await self.store.aclose()

    async def __aenter__(self) -> Self:
        """``async with checker:`` - the block's end awaits :meth:`aclose`."""
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _no_run(tx: Any) -> Any:
    raise AssertionError("claiming runs no handler")
