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
A deadlock with a concurrent writer (the database rolled the transaction back) raises
:class:`~msgpatterns.errors.NeedRetry`: run the handler again in a new transaction.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import suppress
from operator import itemgetter
from typing import Any

from msgpatterns._extras import require
from msgpatterns.errors import ConfigurationError, MalformedMessage, NeedRetry
from msgpatterns.ordering.errors import InvalidVersion, MissingVersion, VersionConflict

require("sqlalchemy", "sql")

from sqlalchemy import (  # noqa: E402
    Column,
    ColumnElement,
    Connection,
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

from msgpatterns.ordering.statements import (  # noqa: E402
    Family,
    deadlocks_retry,
    family,
    insert_if_absent,
    latest_wins_insert,
    newer,
)

__all__ = ["VersionGuard"]

ColumnRef = str | Column[Any]

#: Most bound parameters one batch statement carries (below every dialect's limit).
MAX_PARAMETERS = 10_000


def _is_after(new: Any, old: Any) -> bool:
    """``new > old``; versions that cannot be compared are a malformed message."""
    try:
        return bool(new > old)
    except TypeError as exc:
        raise InvalidVersion(f"cannot compare versions {new!r} and {old!r}: {exc}") from exc


class VersionGuard:
    """Version-checked writes to ``table``, keyed by ``key``, ordered by ``version``.

    Args:
        table: a SQLAlchemy :class:`~sqlalchemy.Table`.
        key: the key column (name or Column), or several for a composite key. They
            must be the primary key or a unique constraint.
        version: the version column: an integer version or a timestamp, anything
            the database orders. A NULL stored version counts as older than any.

    Key values are scalars (a tuple for a composite key); ``values`` map column names
    to new values and may not contain the key or version columns.
    """

    def __init__(
        self, table: Table, key: ColumnRef | Sequence[ColumnRef], version: ColumnRef
    ) -> None:
        refs: Sequence[ColumnRef] = [key] if isinstance(key, str | Column) else key
        if not refs:
            raise ConfigurationError("VersionGuard needs at least one key column")
        self.table = table
        self.key_columns: tuple[Column[Any], ...] = tuple(self._column(r) for r in refs)
        self.version_column: Column[Any] = self._column(version)
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

    # -- reading ------------------------------------------------------------------------

    def read(self, conn: Connection, key: Any) -> RowMapping | None:
        """The stored row of ``key`` as a mapping, or None."""
        row = conn.execute(select(self.table).where(self._match(key))).first()
        return None if row is None else row._mapping

    def stored_version(self, conn: Connection, key: Any) -> Any:
        """The current stored version of ``key``; None if the row is absent or has none.

        A shared-lock read (``FOR SHARE`` / ``LOCK IN SHARE MODE``; plain on SQLite), so
        it sees the latest committed row even inside a REPEATABLE READ transaction.
        """
        query = select(self.version_column).where(self._match(key)).with_for_update(read=True)
        return conn.execute(query).scalar()

    # -- strict transitions -------------------------------------------------------------

    @deadlocks_retry()
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
            if insert_if_absent(conn, self.table, self.key_columns, full, family(conn)):
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
        dialect = family(conn)
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
        dialect = family(conn)
        items = list(latest.items())
        with suppress(TypeError):  # one lock order for all writers: fewer deadlocks
            items.sort(key=itemgetter(0))
        columns = items[0][1]
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

    def _column(self, ref: ColumnRef) -> Column[Any]:
        name = ref if isinstance(ref, str) else ref.key
        if name not in self.table.c:
            raise ConfigurationError(f"table {self.table.name!r} has no column {name!r}")
        column: Column[Any] = self.table.c[name]
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
        if any(part is None for part in parts):
            raise MalformedMessage(f"message has no key (got {key!r})")
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
            if any(part is None for part in key):
                raise MalformedMessage(f"row {dict(row)!r} has no key")
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
