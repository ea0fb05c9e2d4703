"""SqlChecker: the idempotency state machine on a SQL table (SQLAlchemy 2 Core)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from msgpatterns._callables import renamed_arguments
from msgpatterns._extras import require
from msgpatterns.errors import ConfigurationError, seconds
from msgpatterns.idempotency.base import ClaimRequest, Closable, LeaseChecker
from msgpatterns.idempotency.policy import StorePolicy
from msgpatterns.idempotency.records import PROCESSING, Record
from msgpatterns.idempotency.spec import CheckerSpec, policy_options

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection, Engine

    from msgpatterns.idempotency.sql_table import DedupTable

__all__ = ["SqlChecker", "SqlMaintenance", "SqlStore"]


class SqlStore:
    """What both SQL checkers share: the engine, the dedup table, the clock, transient
    errors, purge and spec."""

    def __init__(self, engine_or_url: Engine | str, table: str,
                 clock: Callable[[], float], *, autocommit: bool) -> None:
        sa = require("sqlalchemy", "sql")
        from msgpatterns._sql import transient_errors
        from msgpatterns.idempotency.sql_table import DedupTable

        if isinstance(engine_or_url, str):
            # our own engine: connections set to autocommit once, when they are opened
            options = {"isolation_level": "AUTOCOMMIT"} if autocommit else {}
            self.engine: Engine = self._create_engine(sa, engine_or_url, options)
            self._owns_engine = True
        else:
            self.engine = engine_or_url
            self._owns_engine = False
        self._autocommit = autocommit and self._owns_engine
        self.table: DedupTable = DedupTable(self.engine, table)
        self.clock = clock
        dialect = self.engine.dialect
        #: Any database error, wrapped by SQLAlchemy or raised by the driver.
        self.dbapi_errors: tuple[type[BaseException], ...] = (
            sa.exc.DBAPIError, dialect.loaded_dbapi.Error)
        self.transient: tuple[type[BaseException], ...] = transient_errors(dialect)

    @staticmethod
    def _create_engine(sa: Any, url: str, options: dict[str, Any]) -> Engine:
        """An engine for ``url``; a URL that does not parse is a ConfigurationError that
        never shows the password."""
        from msgpatterns.idempotency.spec import hide_password_in, redact_url

        try:
            engine: Engine = sa.create_engine(url, **options)
        except (sa.exc.ArgumentError, ValueError) as exc:
            raise ConfigurationError(
                f"cannot use SQL URL {redact_url(url)!r}: {hide_password_in(str(exc), url)}"
            ) from None
        return engine

    def statements(self) -> AbstractContextManager[Connection]:
        """A connection for a few statements that commit when the block ends.

        On an engine this checker created, connections are in autocommit (set once,
        when opened): no transaction round trips. On the caller's engine nothing about
        its connections is changed (no isolation level to reset at check-in, which
        would leak the connection when the server dropped it): the statements run in
        an ordinary transaction, committed at the end of the block, and a dead
        connection is invalidated by SQLAlchemy as usual.
        """
        return self.engine.connect() if self._autocommit else self.engine.begin()

    def where(self) -> str:
        """The database URL without its password."""
        return self.engine.url.render_as_string(hide_password=True)

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def cutoff(self, older_than: float | timedelta | None) -> int:
        """Expiry at or before which a record is purged."""
        return self.now_ms() - int((seconds(older_than) or 0.0) * 1000)

    def url(self) -> str:
        url = self.engine.url
        if url.get_backend_name() == "sqlite" and url.database in (None, "", ":memory:"):
            raise ConfigurationError(
                "an in-memory SQLite database cannot be shared with another process; "
                "use a SQLite file or a server URL"
            )
        return url.render_as_string(hide_password=False)

    def close(self) -> None:
        if self._owns_engine:
            self.engine.dispose()


class SqlMaintenance(Closable):
    """Table creation, purge and clean-up, shared by both SQL checkers."""

    store: SqlStore

    def create_table(self) -> None:
        """Create the dedup table if it does not exist (done on first use anyway)."""
        self._check_open()
        self.store.table.create()

    def purge(self, older_than: float | timedelta | None = None) -> int:
        """Delete records that expired at least ``older_than`` ago; returns the count.

        Never touches a live lease or a DONE record within its ttl.
        """
        return sum(self.purge_batches(older_than))

    def purge_batches(self, older_than: float | timedelta | None = None,
                      chunk: int = 5000) -> Iterator[int]:
        """:meth:`purge` in transactions of ``chunk`` rows; yields each one's count."""
        self._check_open()
        return self.store.table.purge_batches(self.store.cutoff(older_than), chunk)

    def count_expired(self, older_than: float | timedelta | None = None) -> int:
        """How many records :meth:`purge` would delete now."""
        self._check_open()
        return self.store.table.count_expired(self.store.cutoff(older_than))



class SqlChecker(SqlMaintenance, LeaseChecker):
    """Idempotency in a SQL table: PostgreSQL, MySQL/MariaDB or SQLite.

    The table (default ``msgpatterns_dedup``) is created on first use or by
    :meth:`create_table`; its key is unique and its expiry column indexed. SQL has no
    TTL: run :meth:`purge` (or ``msgpatterns dedup purge``) now and then.

    Args:
        url: an SQLAlchemy URL or ``Engine`` (the old keyword ``engine_or_url=`` still
            works).
        table: the dedup table's name.
        ttl: seconds a DONE key is remembered.
        lease: seconds a claim holds a key; a crashed owner's key is free after it.
        namespace: first part of every key (``namespace:group:key``).
        policy: retries and the NeedRetry delay when the database is unreachable.
        clock: seconds since the epoch (default ``time.time``); every consumer's clock
            must agree to well under the lease (NTP).
        write_behind: seconds within which a guarded call's completion is written in
            the background, batched (see :mod:`msgpatterns.idempotency.write_behind`).
            None (default): complete before returning.

    Crash semantics: at-least-once. The dedup row is committed separately from the
    handler's effect, so a crash between the two leaves the key PROCESSING until its
    lease expires and the redelivered message is processed again. Use
    :class:`TransactionalSqlChecker` to commit both together (exactly once).
    """

    @renamed_arguments(engine_or_url="url")
    def __init__(
        self,
        url: Engine | str,
        table: str = "msgpatterns_dedup",
        ttl: float | timedelta = 86400,
        lease: float | timedelta = 30,
        *,
        namespace: str = "msgpatterns",
        policy: StorePolicy | None = None,
        clock: Callable[[], float] = time.time,
        write_behind: float | timedelta | None = None,
    ) -> None:
        self.store = SqlStore(url, table, clock, autocommit=True)
        from msgpatterns.idempotency.sql_table import KEY_BYTES

        super().__init__(namespace=namespace, ttl=ttl, lease=lease,
                         max_key_bytes=KEY_BYTES, policy=policy, write_behind=write_behind)
        self.transient = self.store.transient
        self.engine = self.store.engine
        self._lease_ms = int(self.lease * 1000)
        self._ttl_ms = int(self.ttl * 1000)

    def _claim_records(self, requests: Sequence[ClaimRequest]) -> list[Record]:
        self.store.table.create()
        now = self.store.now_ms()
        rows = [{"dedup_key": r.key, "state": PROCESSING, "owner_token": r.token,
                 "fingerprint": r.fingerprint, "result": None,
                 "expires_at": now + self._lease_ms, "updated_at": now} for r in requests]
        with self.store.statements() as conn:
            found = self.store.table.claim(conn, rows, now)
        return [found[r.key] for r in requests]

    def _complete_records(self, items: Sequence[ClaimRequest]) -> list[bool]:
        self.store.table.create()  # also learns whether the table keeps results
        now = self.store.now_ms()
        with self.store.statements() as conn:
            return self.store.table.complete(conn, items, now, now + self._ttl_ms)

    def _release_records(self, items: Sequence[ClaimRequest]) -> list[bool]:
        with self.store.statements() as conn:
            return self.store.table.release(conn, items)

    def spec(self) -> CheckerSpec:
        """The URL and options that rebuild this checker in another process."""
        options: dict[str, Any] = {
            "table": self.store.table.name, "ttl": self.ttl, "lease": self.lease,
            "namespace": self.namespace, "policy": policy_options(self.policy),
            "write_behind": self.write_behind,
        }
        return CheckerSpec("sql", self.store.url(), options)

    def _where(self) -> str:
        return self.store.where()

    def _close(self) -> None:
        self.store.close()
