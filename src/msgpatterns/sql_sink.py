"""COPY-fast batch writes to SQL tables, and :class:`SqlSink`, a Flusher processor.

On PostgreSQL through psycopg 3 (``postgresql+psycopg://``) a batch goes to the
server by ``COPY ... FROM STDIN``, the fastest way PostgreSQL takes rows: one stream
instead of one parsed and planned ``VALUES`` row after another. Everything runs on the
caller's SQLAlchemy connection, inside its transaction, through the driver connection
under it. Elsewhere (MySQL/MariaDB, SQLite, other PostgreSQL drivers) the same calls
run one SQLAlchemy ``executemany``.

* :func:`copy_connection` - the psycopg 3 connection under a SQLAlchemy connection,
  when COPY can be used.
* :func:`stage_rows` - COPY rows into a temporary staging table (one per session and
  column set, emptied at commit) from which one ``INSERT ... SELECT`` writes the
  target: how :meth:`~msgpatterns.ordering.VersionGuard.upsert_latest_many` and
  ``SqlSink(..., on_conflict="ignore")`` work on PostgreSQL.
* :class:`SqlSink` - a Flusher processor that inserts each batch in one transaction.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any, Literal

from msgpatterns._extras import require
from msgpatterns.errors import ConfigurationError

require("sqlalchemy", "sql")

import sqlalchemy as sa  # noqa: E402
from sqlalchemy import Column, Connection, Engine, Table  # noqa: E402
from sqlalchemy.dialects import mysql, postgresql, sqlite  # noqa: E402
from sqlalchemy.sql.expression import TableClause  # noqa: E402

from msgpatterns._sql import dialect_family  # noqa: E402

__all__ = ["SqlSink", "copy_connection", "copy_rows", "copy_transaction", "driver_errors",
           "row_tuples",
           "stage_rows"]

OnConflict = Literal["error", "ignore"]


def copy_connection(conn: Connection) -> Any | None:
    """The psycopg 3 connection under ``conn`` when COPY can be used, else None.

    Only PostgreSQL through psycopg 3's sync connection qualifies (an async engine's
    connection, used through ``run_sync``, takes the executemany path). The SQLAlchemy
    connection is begun first if it is not in a transaction yet (as its first statement
    would), so work done on the driver connection commits or rolls back with the
    caller's transaction.
    """
    dialect = conn.dialect
    if dialect_family(conn) != "postgresql" or dialect.driver != "psycopg" or dialect.is_async:
        return None
    if not conn.in_transaction():
        conn.begin()
    return conn.connection.driver_connection


@contextmanager
def copy_transaction(raw: Any) -> Iterator[None]:
    """A transaction around statements that must share one: the caller's own, or a
    block of its own on an autocommit connection."""
    with raw.transaction() if raw.autocommit else nullcontext():
        yield


def _processors(conn: Connection, columns: Sequence[Column[Any]]) -> list[Any]:
    """Each column's SQLAlchemy bind processor (JSON, Enum, custom types), or None."""
    dialect = conn.dialect
    return [c.type.dialect_impl(dialect).bind_processor(dialect) for c in columns]


def row_tuples(
    columns: Sequence[Column[Any]], rows: Iterable[Mapping[str, Any]]
) -> Iterator[tuple[Any, ...]]:
    """``rows`` (mappings of column keys to values) as tuples in ``columns`` order."""
    names = [c.key for c in columns]
    for row in rows:
        yield tuple([row[n] for n in names])


def _processed(
    conn: Connection, columns: Sequence[Column[Any]], rows: Iterable[Sequence[Any]]
) -> Iterable[Sequence[Any]]:
    """``rows`` through the columns' bind processors (as SQLAlchemy would bind them)."""
    processors = _processors(conn, columns)
    if not any(processors):
        return rows
    return (tuple([v if p is None else p(v) for v, p in zip(row, processors, strict=True)])
            for row in rows)


@contextmanager
def driver_errors(conn: Connection, statement: str) -> Iterator[None]:
    """Raise driver errors of work done on the driver connection as SQLAlchemy's own
    (``IntegrityError``, ``OperationalError``...), as ``conn.execute`` would; a lost
    connection is invalidated, so the pool never hands it out again."""
    dialect = conn.dialect
    try:
        yield
    except dialect.loaded_dbapi.Error as error:
        disconnect = dialect.is_disconnect(error, conn.connection.dbapi_connection, None)
        wrapped = sa.exc.DBAPIError.instance(
            statement, None, error, dialect.loaded_dbapi.Error,
            connection_invalidated=disconnect, dialect=dialect)
        if disconnect:
            conn.invalidate(error)
        raise wrapped from error


def _copy(conn: Connection, raw: Any, target: str, columns: str,
          rows: Iterable[Sequence[Any]]) -> None:
    statement = f"COPY {target} ({columns}) FROM STDIN"
    with driver_errors(conn, statement), raw.cursor() as cursor, \
            cursor.copy(statement) as copy:
        write = copy.write_row
        for row in rows:
            write(row)


def _names(conn: Connection, columns: Sequence[Column[Any]]) -> str:
    quote = conn.dialect.identifier_preparer.quote
    return ", ".join(quote(c.name) for c in columns)


def copy_rows(conn: Connection, table: Table, rows: Sequence[Mapping[str, Any]]) -> None:
    """Insert ``rows`` (mappings of column keys to values, all with the same keys) into
    ``table``: by COPY on PostgreSQL with psycopg 3, else one executemany.

    Constraint violations fail the whole call, as a plain INSERT would.
    """
    if not rows:
        return
    columns = _columns_of(table, rows[0])
    raw = copy_connection(conn)
    if raw is None:
        conn.execute(sa.insert(table), list(rows))
        return
    target = conn.dialect.identifier_preparer.format_table(table)
    with copy_transaction(raw):
        _copy(conn, raw, target, _names(conn, columns),
              _processed(conn, columns, row_tuples(columns, rows)))


def stage_rows(
    conn: Connection, table: Table, columns: Sequence[Column[Any]],
    rows: Iterable[Sequence[Any]],
) -> TableClause:
    """COPY ``rows`` (value tuples in ``columns`` order, see :func:`row_tuples`) into
    this session's staging table for ``table`` and ``columns``; returns the staging
    table for an ``INSERT ... SELECT``.

    Only for a connection :func:`copy_connection` accepts, inside a transaction (the
    staging rows live until its end). The staging table is a ``TEMPORARY`` table
    with the target's column types and no constraints, created on first use in a
    session (``ON COMMIT DELETE ROWS``: emptied at every commit) and emptied before
    each use, so two uses in one transaction never see each other's rows.
    """
    raw: Any = conn.connection.driver_connection
    preparer = conn.dialect.identifier_preparer
    name = _staging_name(table, columns)
    names = _names(conn, columns)
    # one round trip (no parameters: the simple query protocol takes both statements)
    prepare = (f"CREATE TEMPORARY TABLE IF NOT EXISTS {name} ON COMMIT DELETE ROWS AS "
               f"SELECT {names} FROM {preparer.format_table(table)} WITH NO DATA; "
               f"DELETE FROM pg_temp.{name}")
    with driver_errors(conn, prepare), raw.cursor() as cursor:
        cursor.execute(prepare)
    _copy(conn, raw, f"pg_temp.{name}", names, _processed(conn, columns, rows))
    return sa.table(name, *[sa.column(c.name, c.type) for c in columns], schema="pg_temp")


def _staging_name(table: Table, columns: Sequence[Column[Any]]) -> str:
    digest = hashlib.blake2s(
        repr((table.schema, table.name, [c.name for c in columns])).encode(), digest_size=8
    ).hexdigest()
    return f"msgpatterns_stage_{digest}"


def _columns_of(table: Table, row: Mapping[str, Any]) -> list[Column[Any]]:
    unknown = sorted(set(row) - set(table.columns.keys()))
    if unknown:
        raise ConfigurationError(f"table {table.name!r} has no columns {unknown}")
    return [c for c in table.columns if c.key in row]


class SqlSink:
    """A :class:`~msgpatterns.Flusher` processor that inserts each batch into
    ``table`` in one transaction: by COPY on PostgreSQL with psycopg 3, by one
    executemany elsewhere.

    Args:
        engine: where to write (each batch takes a connection from its pool).
        table: the target :class:`~sqlalchemy.Table`.
        row: turns a batch item into a mapping of column keys to values (default: the
            item is that mapping; with ``ack_messages=True`` use
            ``row=lambda m: m.body``). Every item of a batch maps the same columns.
        on_conflict: ``"error"`` (a duplicate key fails the batch, as a plain INSERT)
            or ``"ignore"`` (rows whose primary or unique key exists are skipped: the
            write is idempotent, so a redelivered batch is harmless). On PostgreSQL
            ``"ignore"`` is COPY into a staging table plus one ``INSERT ... SELECT ...
            ON CONFLICT DO NOTHING``; on MySQL/MariaDB ``ON DUPLICATE KEY UPDATE`` a
            no-op (not ``INSERT IGNORE``, which hides other errors).

    Calling the sink with a batch writes it and commits, or raises and writes
    nothing; :meth:`write` does the same on a connection you pass, in your
    transaction. Within a batch, rows with the same key under ``"ignore"``: the first
    is kept.
    """

    def __init__(
        self,
        engine: Engine,
        table: Table,
        *,
        row: Callable[[Any], Mapping[str, Any]] | None = None,
        on_conflict: OnConflict = "error",
    ) -> None:
        if not isinstance(engine, Engine):
            raise ConfigurationError(
                f"SqlSink: engine must be a SQLAlchemy Engine, got {type(engine).__name__}"
            )
        if not isinstance(table, Table):
            raise ConfigurationError(
                f"SqlSink: table must be a SQLAlchemy Table, got {type(table).__name__}"
            )
        if on_conflict not in ("error", "ignore"):
            raise ConfigurationError(
                f"SqlSink: on_conflict must be 'error' or 'ignore', got {on_conflict!r}"
            )
        if row is not None and not callable(row):
            raise ConfigurationError("SqlSink: row must be a callable")
        self.engine = engine
        self.table = table
        self.row = row
        self.on_conflict: OnConflict = on_conflict

    def __call__(self, batch: Sequence[Any]) -> None:
        with self.engine.begin() as conn:
            self.write(conn, batch)

    def write(self, conn: Connection, batch: Sequence[Any]) -> None:
        """Insert ``batch`` on ``conn``, inside its transaction."""
        rows = list(batch) if self.row is None else [self.row(item) for item in batch]
        if not rows:
            return
        if self.on_conflict == "error":
            copy_rows(conn, self.table, rows)
            return
        columns = _columns_of(self.table, rows[0])
        raw = copy_connection(conn)
        if raw is None:
            conn.execute(self._insert_ignoring(conn), rows)
            return
        with copy_transaction(raw):
            staging = stage_rows(conn, self.table, columns, list(row_tuples(columns, rows)))
            insert = postgresql.insert(self.table).from_select(
                [c.name for c in columns], sa.select(*staging.columns)
            ).on_conflict_do_nothing()
            conn.execute(insert)

    def _insert_ignoring(self, conn: Connection) -> Any:
        found = dialect_family(conn)
        if found == "mysql":
            keys = list(self.table.primary_key.columns)
            first = keys[0] if keys else self.table.c[0]
            return mysql.insert(self.table).on_duplicate_key_update({first.name: first})
        if found == "sqlite":
            return sqlite.insert(self.table).on_conflict_do_nothing()
        if found == "postgresql":
            return postgresql.insert(self.table).on_conflict_do_nothing()
        raise ConfigurationError(
            f"SqlSink: on_conflict='ignore' is not supported on {conn.dialect.name!r}")
