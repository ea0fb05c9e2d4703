"""Dialect-specific statements behind :class:`~msgpatterns.ordering.VersionGuard`.

Every statement is SQLAlchemy Core with bound parameters: keys and values from
messages are data, never SQL.

* PostgreSQL and SQLite: ``INSERT ... ON CONFLICT (key) DO UPDATE SET ... WHERE
  stored.version IS NULL OR stored.version < excluded.version``.
* MySQL and MariaDB: ``INSERT ... ON DUPLICATE KEY UPDATE col = CASE WHEN <newer> THEN
  <incoming> ELSE col END, ..., version = CASE ... END``. MySQL evaluates the
  assignments left to right and later ones see earlier results, so the version column
  is assigned last: every other column still compares against the stored version.
  SQLAlchemy renders the incoming row as ``VALUES(col)`` on MariaDB and as a row alias
  on MySQL 8.0.20+. (VersionGuard uses it for batches; see ``upsert_latest`` for why a
  single row takes another path there.)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

from msgpatterns._extras import require
from msgpatterns.errors import ConfigurationError, NeedRetry

require("sqlalchemy", "sql")

from sqlalchemy import (  # noqa: E402
    Column,
    ColumnElement,
    Connection,
    Table,
    and_,
    case,
    insert,
    or_,
    select,
)
from sqlalchemy.dialects import mysql, postgresql, sqlite  # noqa: E402
from sqlalchemy.exc import DBAPIError, IntegrityError  # noqa: E402
from sqlalchemy.sql.dml import Insert  # noqa: E402

__all__ = [
    "Family",
    "deadlocks_retry",
    "family",
    "insert_if_absent",
    "latest_wins_insert",
    "newer",
]

Family = Literal["postgresql", "sqlite", "mysql"]

# MySQL/MariaDB error numbers of a duplicate primary or unique key.
_DUPLICATE_KEY = {1062, 1586}
# A deadlock, or a serialization failure: the database rolled the transaction back.
_MYSQL_DEADLOCK = {1213}
_SQLSTATE_RETRY = {"40P01", "40001"}


def _sqlstate(exc: DBAPIError) -> str | None:
    """The SQLSTATE of a driver error (psycopg2 ``pgcode``, psycopg and PyMySQL
    ``sqlstate``), if the driver reports one."""
    state = getattr(exc.orig, "pgcode", None) or getattr(exc.orig, "sqlstate", None)
    return state if isinstance(state, str) else None


def _errno(exc: DBAPIError) -> int | None:
    """The MySQL/MariaDB error number of a driver error."""
    args = getattr(exc.orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


@contextmanager
def deadlocks_retry() -> Iterator[None]:
    """Turn a deadlock among concurrent writers into :class:`NeedRetry`.

    The database has already rolled the whole transaction back; running the handler
    again in a new transaction is the fix, so this is a "not now", not a failure.
    """
    try:
        yield
    except DBAPIError as exc:
        if _sqlstate(exc) in _SQLSTATE_RETRY or _errno(exc) in _MYSQL_DEADLOCK:
            raise NeedRetry(reason=f"deadlock with a concurrent writer: {exc.orig}") from exc
        raise


def family(conn: Connection) -> Family:
    """The statement family for ``conn``'s database."""
    name = conn.dialect.name
    if name in ("mysql", "mariadb"):
        return "mysql"
    if name == "postgresql":
        return "postgresql"
    if name == "sqlite":
        return "sqlite"
    raise ConfigurationError(
        f"VersionGuard supports PostgreSQL, SQLite, MySQL and MariaDB, not {name!r}"
    )


def newer(stored: ColumnElement[Any], incoming: ColumnElement[Any]) -> ColumnElement[bool]:
    """True where ``incoming`` should replace ``stored`` (a NULL version is oldest)."""
    return or_(stored.is_(None), stored < incoming)


def latest_wins_insert(
    table: Table,
    keys: Sequence[Column[Any]],
    version: Column[Any],
    values: Sequence[Column[Any]],
    dialect: Family,
) -> Insert:
    """An INSERT whose rows overwrite an existing row only when their version is newer.

    A template: execute it with parameter rows (holding ``keys``, ``values`` and
    ``version``), or add rows with ``.values(rows)``; the rows of one execution must
    hold distinct keys.
    """
    if dialect == "mysql":
        stmt = mysql.insert(table)
        wins = newer(version, stmt.inserted[version.key])
        assignments: list[tuple[str, Any]] = [
            (c.key, case((wins, stmt.inserted[c.key]), else_=c)) for c in values
        ]
        assignments.append((version.key, case((wins, stmt.inserted[version.key]), else_=version)))
        return stmt.on_duplicate_key_update(assignments)  # a list keeps this order
    upsert = postgresql.insert(table) if dialect == "postgresql" else sqlite.insert(table)
    return upsert.on_conflict_do_update(
        index_elements=list(keys),
        set_={c.key: upsert.excluded[c.key] for c in [*values, version]},
        where=newer(version, upsert.excluded[version.key]),
    )


def insert_if_absent(
    conn: Connection,
    table: Table,
    keys: Sequence[Column[Any]],
    row: Mapping[str, Any],
    dialect: Family,
) -> bool:
    """Insert ``row`` unless a row with its key exists; True if it inserted.

    Any other integrity error (a NOT NULL column, another unique key) propagates.
    """
    if dialect != "mysql":
        stmt = postgresql.insert(table) if dialect == "postgresql" else sqlite.insert(table)
        done = conn.execute(stmt.values(dict(row)).on_conflict_do_nothing(index_elements=keys))
        return done.rowcount == 1
    # MySQL rolls back only the failed statement, never the transaction; and unlike
    # INSERT IGNORE this does not turn other errors into warnings.
    try:
        conn.execute(insert(table).values(dict(row)))
    except IntegrityError as exc:
        if _errno(exc) not in _DUPLICATE_KEY:
            raise
        # A locking read sees the row another transaction just committed; a plain read
        # under REPEATABLE READ would see this transaction's older snapshot.
        match = and_(*(c == row[c.key] for c in keys))
        current = select(keys[0]).where(match).with_for_update(read=True)
        if conn.execute(current).first() is None:
            raise  # a different unique key clashed
        return False
    return True
