"""VersionGuard: apply out-of-order messages to versioned rows, exactly once and in order.

Two disciplines from the seed article, over one SQLAlchemy table:

* **Strict** (:meth:`VersionGuard.apply`): a message carries the transition
  ``expected -> new``. It applies only to a row at ``expected``; a row already at
  ``new`` or later makes it a stale duplicate (skipped); a row not there yet makes it
  early (:class:`~msgpatterns.errors.NeedRetry`). Gaps in version numbers are fine.
* **Latest wins** (:meth:`VersionGuard.upsert_latest` and the batch form
  :meth:`VersionGuard.upsert_latest_many`): a message carries a version or timestamp;
  an older message never overwrites a newer row, in one conditional statement.

All statements are SQLAlchemy Core with bound parameters. They run on the connection
you pass, inside your transaction, so the write commits together with your own effects.
Every method also accepts an :class:`~sqlalchemy.Engine`: the call then runs in a
transaction of its own (``engine.begin()``), committed when it returns - convenient
when the guarded write is the handler's only effect.
A deadlock with a concurrent writer (the database rolled the transaction back) raises
:class:`~msgpatterns.errors.NeedRetry`: run the handler again in a new transaction.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import suppress
from operator import itemgetter
from typing import Any, Concatenate, ParamSpec, Self, TypeVar

from msgpatterns._extras import require
from msgpatterns.errors import ClosedError, ConfigurationError, MalformedMessage, NeedRetry
from msgpatterns.ordering.errors import InvalidVersion, MissingVersion, VersionConflict

require("sqlalchemy", "sql")

from sqlalchemy import (  # noqa: E402
    Column,
    ColumnElement,
    Connection,
    Engine,
    Index,
    RowMapping,
    Table,
    UniqueConstraint,
    and_,
    literal,
    select,
    tuple_,
    update,
)
from sqlalchemy.sql.dml import Insert  # noqa: E402
from sqlalchemy.sql.expression import TableClause  # noqa: E402

from msgpatterns._sql import Family, family, insert_if_absent  # noqa: E402
from msgpatterns.ordering.statements import (  # noqa: E402
    deadlocks_retry,
    latest_wins_insert,
    newer,
)
from msgpatterns.sql_sink import copy_connection, copy_transaction, stage_rows  # noqa: E402

__all__ = ["VersionGuard"]

ColumnRef = str | Column[Any]

P = ParamSpec("P")
R = TypeVar("R")
G = TypeVar("G", bound="VersionGuard")

#: Most bound parameters one batch statement carries (below every dialect's limit).
MAX_PARAMETERS = 10_000

#: From this many rows (after dedup) a PostgreSQL batch on psycopg 3 goes by COPY to a
#: staging table; smaller ones by executemany, which takes fewer round trips.
COPY_MIN_ROWS = 100


def _family(conn: Connection) -> Family:
    return family(conn, what="VersionGuard")


def _is_after(new: Any, old: Any) -> bool:
    """``new > old``; versions that cannot be compared are a malformed message."""
    try:
        return bool(new > old)
    except TypeError as exc:
        raise InvalidVersion(f"cannot compare versions {new!r} and {old!r}: {exc}") from exc


def _blank(part: Any) -> bool:
    """A key part that names no row: None, or empty text or bytes."""
    return part is None or (isinstance(part, str | bytes) and not part)


def _on_connection(
    method: Callable[Concatenate[G, Connection, P], R],
) -> Callable[Concatenate[G, Connection | Engine, P], R]:
    """Let ``method`` take an Engine too: it then runs in its own transaction
    (``engine.begin()``, committed on return, rolled back on error). Anything else as
    ``conn`` is a :class:`ConfigurationError` naming the argument; after ``close()``
    every call raises :class:`~msgpatterns.errors.ClosedError`."""

    @functools.wraps(method)
    def run(self: G, conn: Connection | Engine, /, *args: P.args, **kwargs: P.kwargs) -> R:
        if self.closed:
            raise ClosedError(f"VersionGuard.{method.__name__}: the guard of "
                              f"{self.table.name!r} is closed")
        if isinstance(conn, Connection):
            return method(self, conn, *args, **kwargs)
        if isinstance(conn, Engine):
            with conn.begin() as transaction:
                return method(self, transaction, *args, **kwargs)
        hint = " (with an ORM Session pass session.connection())" if hasattr(
            conn, "connection") else ""
        raise ConfigurationError(
            f"VersionGuard.{method.__name__}: conn must be a SQLAlchemy Connection (your "
            f"transaction: `with engine.begin() as conn`) or an Engine (one transaction "
            f"per call), got {type(conn).__name__}{hint}"
        )

    return run


class VersionGuard:
    """Version-checked writes to ``table``, keyed by ``key``, ordered by ``version``.

    Args:
        table: a SQLAlchemy :class:`~sqlalchemy.Table`.
        key: the key column (name or Column), or several for a composite key. They
            must be the primary key or a unique constraint.
        version: the version column: an integer version or a timestamp, anything
            the database orders. A NULL stored version counts as older than any.

    Key values are scalars (a tuple for a composite key); ``values`` map column names
    to new values and may not contain the key or version columns. A key that is None or
    empty (``""``, ``b""``) names no row: it raises
    :class:`~msgpatterns.errors.MalformedMessage` (the message is dead-lettered).

    Every method takes ``conn``: a :class:`~sqlalchemy.Connection` (the statements run
    in your transaction) or an :class:`~sqlalchemy.Engine` (each call runs in a
    transaction of its own, committed when it returns). Anything else raises
    :class:`~msgpatterns.errors.ConfigurationError`, as do a ``table`` that is not a
    :class:`~sqlalchemy.Table` and ``key``/``version`` that are not columns of it (or
    names of its columns).

    A guard holds no connection (each call uses the one it is given); it is a context
    manager all the same, like every part: after :meth:`close` (or the ``with`` block)
    every method raises :class:`~msgpatterns.errors.ClosedError`.
    """

    #: True once :meth:`close` was called.
    closed = False

    def __init__(
        self, table: Table, key: ColumnRef | Sequence[ColumnRef], version: ColumnRef
    ) -> None:
        if not isinstance(table, Table):
            raise ConfigurationError(
                f"VersionGuard: table must be a SQLAlchemy Table, got {table!r} "
                f"({type(table).__name__}); describe it with Table(name, MetaData(), "
                "Column(...), ...) or reflect it with Table(name, MetaData(), "
                "autoload_with=engine)"
            )
        refs: Sequence[ColumnRef] = [key] if isinstance(key, str | Column) else key
        if isinstance(refs, bytes) or not isinstance(refs, Sequence) or not refs:
            raise ConfigurationError(
                f"VersionGuard: key must name a column (or several), got {key!r}"
            )
        self.table = table
        self.key_columns: tuple[Column[Any], ...] = tuple(self._column(r, "key") for r in refs)
        self.version_column: Column[Any] = self._column(version, "version")
        if self.version_column in self.key_columns:
            raise ConfigurationError("the version column cannot be part of the key")
        if not self._key_is_unique():
            raise ConfigurationError(
                f"key {[c.key for c in self.key_columns]} of table {table.name!r} must be "
                "its primary key or a unique constraint"
            )
        self._fixed = {c.key for c in self.key_columns} | {self.version_column.key}
        self._value_names = {c.key for c in table.columns} - self._fixed
        self._templates: dict[tuple[Family, frozenset[str], bool], Insert] = {}
        self._copy_templates: dict[tuple[str, frozenset[str], str], Insert] = {}

    # -- lifecycle ----------------------------------------------------------------------

    def close(self) -> None:
        """Drop the cached statements; afterwards every method raises
        :class:`~msgpatterns.errors.ClosedError`. Idempotent. The connections and
        engines the calls were given are the caller's: they stay open."""
        self.closed = True
        self._templates.clear()
        self._copy_templates.clear()

    def __enter__(self) -> Self:
        """``with guard:`` - the block's end calls :meth:`close`."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- reading ------------------------------------------------------------------------

    @_on_connection
    def read(self, conn: Connection, key: Any) -> RowMapping | None:
        """The stored row of ``key`` as a mapping, or None."""
        row = conn.execute(select(self.table).where(self._match(key))).first()
        return None if row is None else row._mapping

    @_on_connection
    def stored_version(self, conn: Connection, key: Any) -> Any:
        """The current stored version of ``key``; None if the row is absent or has none.

        A shared-lock read (``FOR SHARE`` / ``LOCK IN SHARE MODE``; plain on SQLite), so
        it sees the latest committed row even inside a REPEATABLE READ transaction.
        """
        query = select(self.version_column).where(self._match(key)).with_for_update(read=True)
        return conn.execute(query).scalar()

    # -- strict transitions -------------------------------------------------------------

    @deadlocks_retry()
    @_on_connection
    def compare_and_set(
        self,
        conn: Connection,
        key: Any,
        expected: Any,
        new: Any,
        values: Mapping[str, Any] | None = None,
    ) -> bool:
        """Write ``values`` and version ``new`` if the row is at version ``expected``.

        ``expected=None`` means "no version yet": the row is created (or a row with a
        NULL version is updated). Returns whether it wrote. This is the ``save`` of an
        :func:`~msgpatterns.optimistic_update`.
        """
        row = self._values(values)
        row[self.version_column.key] = new
        match = self._match(key)
        if expected is None:
            full = {**self._key_values(key), **row}
            if insert_if_absent(conn, self.table, self.key_columns, full, _family(conn)):
                return True
            # Read before writing: on MySQL the failed INSERT holds a shared lock, and
            # upgrading it for nothing invites deadlocks with concurrent writers.
            if self.stored_version(conn, key) is not None:
                return False
            condition = self.version_column.is_(None)
        else:
            condition = self.version_column == expected
        done = conn.execute(update(self.table).where(match, condition).values(row))
        return bool(done.rowcount == 1)

    @deadlocks_retry()
    @_on_connection
    def apply(
        self,
        conn: Connection,
        key: Any,
        expected: Any,
        new: Any,
        values: Mapping[str, Any] | None = None,
    ) -> bool:
        """Apply the transition ``expected -> new`` of ``key`` exactly once, in order.

        Returns True when it applied, False for a stale duplicate (the row is already at
        ``new`` or later). Raises :class:`~msgpatterns.errors.NeedRetry` when the
        message came early (the row is absent or before ``expected``);
        :class:`~msgpatterns.ordering.MissingVersion` / ``InvalidVersion`` when ``new``
        is missing or not after ``expected``; and
        :class:`~msgpatterns.ordering.VersionConflict` when the row moved past
        ``expected`` on another path, so the transition can never apply.

        ``expected=None`` is the first version: the message creates the row.
        """
        if new is None:
            raise MissingVersion(f"message for key {key!r} has no version")
        if expected is not None and not _is_after(new, expected):
            raise InvalidVersion(f"version {new!r} is not after {expected!r} (key {key!r})")
        if self.compare_and_set(conn, key, expected, new, values):
            return True
        stored = self.stored_version(conn, key)
        if stored is not None and not _is_after(new, stored):
            return False
        if stored is None or (expected is not None and not _is_after(stored, expected)):
            raise NeedRetry(
                reason=f"key {key!r} is at version {stored!r}, waiting for {expected!r} "
                f"before applying {new!r}"
            )
        raise VersionConflict(
            f"key {key!r} is at version {stored!r}: the transition {expected!r} -> {new!r} "
            "can never apply (was the version changed outside the message flow?)"
        )

    # -- latest wins --------------------------------------------------------------------

    @deadlocks_retry()
    @_on_connection
    def upsert_latest(
        self,
        conn: Connection,
        key: Any,
        version: Any,
        values: Mapping[str, Any] | None = None,
    ) -> bool:
        """Insert or overwrite the row of ``key`` unless it already holds ``version`` or
        later. Returns whether it wrote (exact on every dialect).

        PostgreSQL and SQLite: one ``INSERT ... ON CONFLICT DO UPDATE ... WHERE``.
        MySQL/MariaDB: a plain read of the stored version, then one conditional write
        (an UPDATE, or an INSERT for a new key). The writes are conditional, so an
        older message never overwrites a newer row whatever runs concurrently.
        """
        if version is None:
            raise MissingVersion(f"message for key {key!r} has no version")
        row = {**self._key_values(key), **self._values(values)}
        row[self.version_column.key] = version
        dialect = _family(conn)
        if dialect != "mysql":
            return bool(conn.execute(self._latest_wins(dialect, row), row).rowcount == 1)
        # SQLAlchemy's MySQL drivers connect with CLIENT_FOUND_ROWS, so the row count of
        # ON DUPLICATE KEY UPDATE cannot tell "inserted" from "left unchanged". The read
        # takes no lock (an UPDATE of a missing key would take a gap lock, and two
        # creators of one key would deadlock); stored versions only grow, so a read
        # that is already new enough settles it.
        found = conn.execute(select(self.version_column).where(self._match(key))).first()
        if found is None:
            if insert_if_absent(conn, self.table, self.key_columns, row, dialect):
                return True
            stored = self.stored_version(conn, key)  # created meanwhile: read it again
        else:
            stored = found[0]
        if stored is not None and not _is_after(version, stored):
            return False
        newer_than_stored = update(self.table).where(
            self._match(key), newer(self.version_column, literal(version, self.version_column.type))
        ).values({k: v for k, v in row.items() if k not in self._key_names})
        return bool(conn.execute(newer_than_stored).rowcount)

    @deadlocks_retry()
    @_on_connection
    def upsert_latest_many(self, conn: Connection, rows: Iterable[Mapping[str, Any]]) -> int:
        """:meth:`upsert_latest` for many rows in one executemany; returns rows written.

        Each row maps column names to values and holds the key and version columns;
        all rows have the same columns. Several rows of one key collapse to the one
        with the highest version (the first of equals). A row without a version raises
        :class:`~msgpatterns.ordering.MissingVersion` before anything is written.

        The count is exact on PostgreSQL and SQLite. On MySQL/MariaDB the write is an
        ``INSERT ... ON DUPLICATE KEY UPDATE``, whose row count cannot tell a new row
        from an unchanged one, so the count comes from the stored versions read just
        before: a concurrent writer of the same keys can skew it, never the data.
        Large inputs go in chunks of at most ``MAX_PARAMETERS`` bound values.
        """
        latest = self._latest_per_key(rows)
        if not latest:
            return 0
        dialect = _family(conn)
        items = list(latest.items())
        with suppress(TypeError):  # one lock order for all writers: fewer deadlocks
            items.sort(key=itemgetter(0))
        columns = items[0][1]
        if dialect == "postgresql" and len(items) >= COPY_MIN_ROWS:
            raw = copy_connection(conn)
            if raw is not None:
                names = [c.key for c in self.table.columns if c.key in columns]
                return self.copy_upsert(
                    conn, raw, names, [tuple([row[n] for n in names]) for _, row in items])
        # Executemany: compiled once, sent in pages by SQLAlchemy. RETURNING yields just
        # the rows written (older SQLite without RETURNING sums the row counts).
        returning = dialect != "mysql" and conn.dialect.insert_returning
        template = self._latest_wins(dialect, columns, returning)
        written = 0
        for batch in _chunks(items, max(1, MAX_PARAMETERS // len(columns))):
            params = [row for _, row in batch]
            if dialect == "mysql":
                written += self._count_newer(conn, batch)
                conn.execute(template, params)
            elif returning:
                written += len(conn.execute(template, params).all())
            else:
                written += conn.execute(template, params).rowcount
        return written

    def copy_upsert(
        self, conn: Connection, raw: Any, names: Sequence[str], rows: Sequence[Sequence[Any]]
    ) -> int:
        """PostgreSQL with psycopg 3: COPY ``rows`` (value tuples for the columns
        ``names``, one row per key, no key or version None) into a staging table, then
        one ``INSERT ... SELECT ... ON CONFLICT DO UPDATE ... WHERE`` (the latest-wins
        statement) in key order; its row count is the rows written. ``raw`` is
        :func:`~msgpatterns.sql_sink.copy_connection` of ``conn``."""
        columns = [self.table.c[n] for n in names]
        with copy_transaction(raw):
            staging = stage_rows(conn, self.table, columns, rows)
            return int(conn.execute(self._from_staging(staging, columns)).rowcount)

    def _from_staging(self, staging: TableClause, columns: list[Column[Any]]) -> Insert:
        """The latest-wins INSERT of every staging row, in key order (one lock order
        for concurrent writers), built once per staging table."""
        cache_key = ("postgresql", frozenset(c.key for c in columns), staging.name)
        template = self._copy_templates.get(cache_key)
        if template is None:
            values = [c for c in columns if c.key not in self._fixed]
            source = select(*staging.columns).order_by(
                *(staging.c[c.name] for c in self.key_columns))
            template = latest_wins_insert(
                self.table, self.key_columns, self.version_column, values, "postgresql",
                source=([c.name for c in columns], source),
            )
            self._copy_templates[cache_key] = template
        return template

    # -- helpers ------------------------------------------------------------------------

    def _latest_wins(
        self, dialect: Family, row: Mapping[str, Any], returning: bool = False
    ) -> Insert:
        """The latest-wins INSERT for rows with the columns of ``row`` (built once);
        with ``returning`` it returns the key of every row it wrote."""
        cache_key = (dialect, frozenset(row), returning)
        template = self._templates.get(cache_key)
        if template is None:
            values = [c for c in self.table.columns if c.key in row and c.key not in self._fixed]
            template = latest_wins_insert(
                self.table, self.key_columns, self.version_column, values, dialect
            )
            if returning:
                template = template.returning(*self.key_columns)
            self._templates[cache_key] = template
        return template

    @property
    def _key_names(self) -> set[str]:
        return {c.key for c in self.key_columns}

    def _column(self, ref: ColumnRef, what: str) -> Column[Any]:
        """The column of ``self.table`` that ``ref`` (a name or one of its Columns)
        designates as the ``what`` column."""
        table = self.table
        if isinstance(ref, Column):
            if ref.table is not table:
                raise ConfigurationError(
                    f"VersionGuard: {what} column {ref} is not a column of table "
                    f"{table.name!r}; pass {table.name}.c.<name> or the column name"
                )
            return ref
        if not isinstance(ref, str):
            raise ConfigurationError(
                f"VersionGuard: {what} must be a column name or a Column of table "
                f"{table.name!r}, got {ref!r}"
            )
        if ref not in table.c:
            raise ConfigurationError(
                f"VersionGuard: {what}: table {table.name!r} has no column {ref!r}"
            )
        column: Column[Any] = table.c[ref]
        return column

    def _key_is_unique(self) -> bool:
        wanted = set(self.key_columns)
        candidates: list[set[Column[Any]]] = [set(self.table.primary_key.columns)]
        for item in (*self.table.constraints, *self.table.indexes):
            if isinstance(item, UniqueConstraint) or (isinstance(item, Index) and item.unique):
                candidates.append({c for c in item.columns if isinstance(c, Column)})
        return wanted in candidates

    def _key_tuple(self, key: Any) -> tuple[Any, ...]:
        composite = len(self.key_columns) > 1
        if not composite:
            parts: tuple[Any, ...] = (key,)
        elif isinstance(key, Sequence) and not isinstance(key, str | bytes) \
                and len(key) == len(self.key_columns):
            parts = tuple(key)
        else:
            raise ConfigurationError(
                f"key {key!r} does not match key columns {[c.key for c in self.key_columns]}"
            )
        if any(_blank(part) for part in parts):
            raise MalformedMessage(f"message has no key: key {key!r} is None or empty")
        return parts

    def _key_values(self, key: Any) -> dict[str, Any]:
        return {c.key: v for c, v in zip(self.key_columns, self._key_tuple(key), strict=True)}

    def _match(self, key: Any) -> ColumnElement[bool]:
        return and_(*(c == v for c, v in zip(self.key_columns, self._key_tuple(key), strict=True)))

    def _values(self, values: Mapping[str, Any] | None) -> dict[str, Any]:
        if not values:
            return {}
        wrong = set(values) - self._value_names
        if wrong:
            fixed = wrong & self._fixed
            raise ConfigurationError(
                f"values may not set the key or version columns: {sorted(fixed)}" if fixed
                else f"table {self.table.name!r} has no columns {sorted(wrong)}"
            )
        return dict(values)

    def _latest_per_key(
        self, rows: Iterable[Mapping[str, Any]]
    ) -> dict[tuple[Any, ...], dict[str, Any]]:
        latest: dict[tuple[Any, ...], dict[str, Any]] = {}
        columns: set[str] | None = None
        version = self.version_column.key
        for row in rows:
            if columns is None:
                columns = set(row)
                missing = self._fixed - columns
                if missing - {version}:
                    raise ConfigurationError(f"rows lack key columns {sorted(missing)}")
                self._values(dict.fromkeys(columns - self._fixed))
            elif set(row) != columns:
                raise ConfigurationError("all rows of a batch must have the same columns")
            if row.get(version) is None:
                raise MissingVersion(f"row {dict(row)!r} has no {version!r}")
            key = tuple(row[c.key] for c in self.key_columns)
            if any(_blank(part) for part in key):
                raise MalformedMessage(f"row {dict(row)!r} has no key (None or empty)")
            kept = latest.get(key)
            if kept is None or _is_after(row[version], kept[version]):
                latest[key] = dict(row)
        return latest

    def _count_newer(
        self, conn: Connection, batch: Sequence[tuple[tuple[Any, ...], Mapping[str, Any]]]
    ) -> int:
        """How many rows of ``batch`` are newer than what is stored (MySQL counting)."""
        keys = [key for key, _ in batch]
        target = self.key_columns[0] if len(self.key_columns) == 1 else tuple_(*self.key_columns)
        wanted = [k[0] for k in keys] if len(self.key_columns) == 1 else keys
        query = select(*self.key_columns, self.version_column).where(target.in_(wanted))
        stored = {tuple(r[:-1]): r[-1] for r in conn.execute(query)}
        version = self.version_column.key
        return sum(
            1 for key, row in batch
            if stored.get(key) is None or _is_after(row[version], stored[key])
        )


def _chunks(items: list[Any], size: int) -> Iterator[list[Any]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]
