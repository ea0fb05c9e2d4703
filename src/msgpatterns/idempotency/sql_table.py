"""The dedup table and its dialect-correct statements (PostgreSQL, MySQL/MariaDB, SQLite).

One row per key: ``dedup_key`` (primary key), ``state`` (``P``/``D``),
``owner_token``, ``fingerprint``, ``expires_at`` (indexed) and ``updated_at``, both
milliseconds since the epoch. Claiming is one statement that inserts the row when the
key is absent and takes over a row whose expiry has passed, and leaves a live row
untouched:

* PostgreSQL and SQLite: ``INSERT ... ON CONFLICT (dedup_key) DO UPDATE SET
  col = CASE WHEN expires_at <= :now THEN excluded.col ELSE col END RETURNING ...``
  (the row as it stands afterwards comes back in the same round trip);
* MySQL/MariaDB: ``INSERT ... ON DUPLICATE KEY UPDATE`` with the same CASE (never
  ``INSERT IGNORE``, which would hide errors other than the duplicate), then a read.

Keys are always bound parameters. On MySQL/MariaDB the key column is ``VARBINARY``,
so keys compare byte for byte: no case folding, no trailing-space padding.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.engine import Connection, Dialect, Engine
from sqlalchemy.types import TypeDecorator, TypeEngine

from msgpatterns.idempotency.records import DONE, PROCESSING, Record

__all__ = ["KEY_BYTES", "DedupTable"]

#: Longest stored key, in UTF-8 bytes; longer keys are stored as their SHA-256.
KEY_BYTES = 255
_CHUNK = 500
_TAKEOVER_COLUMNS = ("state", "owner_token", "fingerprint", "updated_at", "expires_at")


#: (key, owner token, fingerprint) of a claimed key.
Owned = tuple[str, str, "str | None"]


def _chunks(items: Sequence[Owned]) -> Iterator[list[Owned]]:
    for start in range(0, len(items), _CHUNK):
        yield list(items[start:start + _CHUNK])


def _is_mysql(dialect: Dialect) -> bool:
    return dialect.name in ("mysql", "mariadb")


class DedupKey(TypeDecorator[str]):
    """Text keys; stored as VARBINARY on MySQL/MariaDB for exact comparison."""

    impl = sa.String
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if _is_mysql(dialect):
            return dialect.type_descriptor(mysql.VARBINARY(KEY_BYTES))
        return dialect.type_descriptor(sa.String(KEY_BYTES))

    def process_bind_param(self, value: str | None, dialect: Dialect) -> Any:
        return value.encode("utf-8") if value is not None else None

    def process_result_value(self, value: Any, dialect: Dialect) -> str | None:
        return value.decode("utf-8") if isinstance(value, bytes) else value

    # Text needs no conversion elsewhere: no per-value call on PostgreSQL and SQLite.
    def bind_processor(self, dialect: Dialect) -> Any:
        return super().bind_processor(dialect) if _is_mysql(dialect) else None

    def result_processor(self, dialect: Dialect, coltype: object) -> Any:
        return super().result_processor(dialect, coltype) if _is_mysql(dialect) else None


def dedup_table(name: str, metadata: sa.MetaData) -> sa.Table:
    """The table definition (shared by SqlChecker and TransactionalSqlChecker)."""
    return sa.Table(
        name, metadata,
        sa.Column("dedup_key", DedupKey(KEY_BYTES), primary_key=True),
        sa.Column("state", sa.String(1), nullable=False),
        sa.Column("owner_token", sa.String(32), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=True),
        sa.Column("expires_at", sa.BigInteger, nullable=False, index=True),
        sa.Column("updated_at", sa.BigInteger, nullable=False),
    )


class DedupTable:
    """The statements of one dedup table on one engine. Creates the table on first use."""

    def __init__(self, engine: Engine, name: str) -> None:
        self.engine = engine
        self.name = name
        self.table = dedup_table(name, sa.MetaData())
        self.dialect = engine.dialect
        self._created = False
        self._lock = threading.Lock()

    # -- schema ---------------------------------------------------------------------------

    def create(self) -> None:
        """Create the table and its expiry index if missing (safe to race)."""
        if self._created:
            return
        with self._lock:
            if self._created:
                return
            try:
                self.table.create(self.engine, checkfirst=True)
            except sa.exc.DBAPIError:
                # another process created it between the check and the create
                if not sa.inspect(self.engine).has_table(self.name):
                    raise
            self._created = True

    def drop(self) -> None:
        """Drop the table (tests and tear-down)."""
        self.table.drop(self.engine, checkfirst=True)
        self._created = False

    # -- claim ----------------------------------------------------------------------------

    def claim(
        self, conn: Connection, rows: Sequence[dict[str, Any]], now: int, *, lock: bool = False,
    ) -> dict[str, Record]:
        """Insert each row (``updated_at`` = ``now``) whose key is absent or expired;
        return every key's row as it stands afterwards. ``lock``: read back with ``FOR
        UPDATE`` (inside a transaction that keeps the rows)."""
        found: dict[str, Record] = {}
        ordered = sorted(rows, key=lambda row: row["dedup_key"])  # one lock order: no deadlock
        for start in range(0, len(ordered), _CHUNK):
            chunk = ordered[start:start + _CHUNK]
            if _is_mysql(self.dialect):
                conn.execute(self._claim_statement, chunk)
                query = sa.select(*self._returned).where(
                    self.table.c.dedup_key.in_([row["dedup_key"] for row in chunk]))
                result = conn.execute(query.with_for_update() if lock else query)
            else:  # one statement; SQLAlchemy sends the rows as one multi-row VALUES
                result = conn.execute(self._claim_statement, chunk)
            for key, state, token, fingerprint, expires_at in result:
                found[key] = Record(state, token, fingerprint, (expires_at - now) / 1000)
        return found

    @property
    def _returned(self) -> tuple[sa.Column[Any], ...]:
        c = self.table.c
        return (c.dedup_key, c.state, c.owner_token, c.fingerprint, c.expires_at)

    @functools.cached_property
    def _claim_statement(self) -> Any:
        """The insert-or-take-over statement, built (and compiled) once. The incoming
        row's ``updated_at`` is the claim's "now", so the statement has no parameter
        outside its VALUES and batches as an executemany."""
        c = self.table.c
        if _is_mysql(self.dialect):
            stmt: Any = mysql.insert(self.table)
            incoming = stmt.inserted
        else:
            insert = postgresql.insert if self.dialect.name == "postgresql" else sqlite.insert
            stmt = insert(self.table)
            incoming = stmt.excluded
        expired = c.expires_at <= incoming.updated_at
        # expires_at last: MySQL evaluates the assignments left to right
        takeover = [(name, sa.case((expired, incoming[name]), else_=c[name]))
                    for name in _TAKEOVER_COLUMNS]
        if _is_mysql(self.dialect):
            return stmt.on_duplicate_key_update(takeover)
        return stmt.on_conflict_do_update(
            index_elements=[c.dedup_key], set_=dict(takeover),
        ).returning(*self._returned)

    # -- complete / release -----------------------------------------------------------------

    def _owned_by(self, chunk: Sequence[Owned]) -> Any:
        """Rows whose (key, token) is one of ``chunk``'s pairs. Written as two IN lists,
        which every database answers from the primary key (a row-value IN is planned
        as a long OR): a token is only ever issued for one key, so a row can match a
        key of the list and a token of the list only as one of the pairs."""
        c = self.table.c
        return sa.and_(c.dedup_key.in_([key for key, _, _ in chunk]),
                       c.owner_token.in_([token for _, token, _ in chunk]))

    def complete(self, conn: Connection, items: Sequence[Owned], now: int,
                 expires_at: int) -> list[bool]:
        """Per (key, token, fingerprint): mark DONE until ``expires_at`` if the token
        still owns the key, or insert it DONE if its row is gone (purged after its lease
        expired). True also when it is DONE by that token already: a retried call."""
        outcome: list[bool] = []
        for chunk in _chunks(items):
            touched = conn.execute(sa.update(self.table).where(self._owned_by(chunk)).values(
                state=DONE, expires_at=expires_at, updated_at=now)).rowcount
            if touched == len(chunk):
                outcome.extend([True] * len(chunk))
                continue
            gone = [{"dedup_key": key, "state": DONE, "owner_token": token,
                     "fingerprint": fingerprint, "expires_at": expires_at, "updated_at": now}
                    for key, token, fingerprint in chunk]
            found = self.claim(conn, gone, now)
            outcome.extend(found[key].token == token and found[key].state == DONE
                           for key, token, _ in chunk)
        return outcome

    def release(self, conn: Connection, items: Sequence[Owned]) -> list[bool]:
        """Per (key, token, _): delete the PROCESSING row if the token still owns it; True
        for the rows this call deleted."""
        c = self.table.c
        outcome: list[bool] = []
        for chunk in _chunks(items):
            pairs = [(key, token) for key, token, _ in chunk]
            stmt = sa.delete(self.table).where(self._owned_by(chunk), c.state == PROCESSING)
            if self.dialect.delete_returning:
                deleted = set(conn.scalars(stmt.returning(c.dedup_key)))
                outcome.extend(key in deleted for key, _ in pairs)
                continue
            touched = conn.execute(stmt).rowcount
            if touched in (0, len(chunk)):
                outcome.extend([touched > 0] * len(chunk))
                continue
            # MySQL has no DELETE ... RETURNING: a pair whose key is gone was ours
            present = set(conn.scalars(sa.select(c.dedup_key).where(
                c.dedup_key.in_([key for key, _ in pairs]))))
            outcome.extend(key not in present for key, _ in pairs)
        return outcome

    # -- purge ------------------------------------------------------------------------------

    def count_expired(self, cutoff: int) -> int:
        """Rows whose expiry is at or before ``cutoff`` (ms since the epoch)."""
        self.create()
        with self.engine.connect() as conn:
            query = sa.select(sa.func.count()).select_from(self.table).where(
                self.table.c.expires_at <= cutoff)
            return int(conn.execute(query).scalar_one())

    def purge_batches(self, cutoff: int, chunk: int) -> Iterator[int]:
        """Delete rows expired at or before ``cutoff``, ``chunk`` rows per transaction
        (short locks on a large table); yields each transaction's count."""
        self.create()
        c = self.table.c
        while True:
            with self.engine.begin() as conn:
                keys = list(conn.scalars(sa.select(c.dedup_key).where(
                    c.expires_at <= cutoff).order_by(c.expires_at).limit(chunk)))
                if not keys:
                    return
                deleted = conn.execute(sa.delete(self.table).where(
                    c.dedup_key.in_(keys), c.expires_at <= cutoff)).rowcount
            yield deleted
            if len(keys) < chunk:
                return
