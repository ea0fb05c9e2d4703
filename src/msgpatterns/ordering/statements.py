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

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from msgpatterns._extras import require
from msgpatterns.errors import NeedRetry

require("sqlalchemy", "sql")

from sqlalchemy import Column, ColumnElement, Table, case, or_  # noqa: E402
from sqlalchemy.dialects import mysql, postgresql, sqlite  # noqa: E402
from sqlalchemy.exc import DBAPIError  # noqa: E402
from sqlalchemy.sql import Select  # noqa: E402
from sqlalchemy.sql.dml import Insert  # noqa: E402

from msgpatterns._sql import Family, is_deadlock  # noqa: E402

__all__ = ["deadlocks_retry", "latest_wins_insert", "newer"]


@contextmanager
def deadlocks_retry() -> Iterator[None]:
    """Turn a deadlock among concurrent writers into :class:`NeedRetry`.

    The database has already rolled the whole transaction back; running the handler
    again in a new transaction is the fix, so this is a "not now", not a failure.
    """
    try:
        yield
    except DBAPIError as exc:
        if is_deadlock(exc):
            raise NeedRetry(reason=f"deadlock with a concurrent writer: {exc.orig}") from exc
        raise


def newer(stored: ColumnElement[Any], incoming: ColumnElement[Any]) -> ColumnElement[bool]:
    """True where ``incoming`` should replace ``stored`` (a NULL version is oldest)."""
    return or_(stored.is_(None), stored < incoming)


def latest_wins_insert(
    table: Table,
    keys: Sequence[Column[Any]],
    version: Column[Any],
    values: Sequence[Column[Any]],
    dialect: Family,
    source: tuple[Sequence[str], Select[Any]] | None = None,
) -> Insert:
    """An INSERT whose rows overwrite an existing row only when their version is newer.

    A template: execute it with parameter rows (holding ``keys``, ``values`` and
    ``version``), or add rows with ``.values(rows)``; the rows of one execution must
    hold distinct keys. With ``source`` (column names and a SELECT; PostgreSQL and
    SQLite) it is an ``INSERT ... SELECT`` of those rows instead.
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
    if source is not None:
        upsert = upsert.from_select(source[0], source[1])
    # SQLAlchemy reads an INSERT's row count only when asked (psycopg 3 needs it).
    return upsert.on_conflict_do_update(
        index_elements=list(keys),
        set_={c.key: upsert.excluded[c.key] for c in [*values, version]},
        where=newer(version, upsert.excluded[version.key]),
    ).execution_options(preserve_rowcount=True)
