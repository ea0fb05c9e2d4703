"""SQL plumbing shared by every SQL user: the checkers, VersionGuard, SqlSink and the
Spark sinks.

* :func:`family` / :func:`dialect_family` - which statement family a database takes
  (PostgreSQL, SQLite, MySQL/MariaDB);
* :func:`transient_errors`, :func:`is_deadlock`, :func:`is_duplicate_key` - how a
  database error is classified (worth retrying, a rolled-back deadlock, a duplicate
  key);
* :func:`create_table` - create a table unless it exists, safe to race with another
  process doing the same (and :class:`OnFirstUse` to do it once per process);
* :func:`insert_if_absent` - insert a row unless its key exists, on every dialect.

Needs the ``[sql]`` extra (SQLAlchemy); importing this module without it raises the
ImportError that names the extra.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from msgpatterns._extras import require
from msgpatterns.errors import ConfigurationError

require("sqlalchemy", "sql")

import sqlalchemy as sa  # noqa: E402
from sqlalchemy.dialects import postgresql, sqlite  # noqa: E402
from sqlalchemy.engine import Connection, Dialect, Engine  # noqa: E402

__all__ = [
    "Family",
    "OnFirstUse",
    "create_table",
    "dialect_family",
    "family",
    "insert_if_absent",
    "is_deadlock",
    "is_duplicate_key",
    "is_mysql",
    "transient_errors",
]

#: The statement families msgpatterns writes SQL for.
Family = Literal["postgresql", "sqlite", "mysql"]

_FAMILIES: dict[str, Family] = {
    "postgresql": "postgresql", "sqlite": "sqlite", "mysql": "mysql", "mariadb": "mysql",
}
# MySQL/MariaDB error numbers of a duplicate primary or unique key.
_DUPLICATE_KEY = {1062, 1586}
# A deadlock, or a serialization failure: the database rolled the transaction back.
_MYSQL_DEADLOCK = {1213}
_SQLSTATE_RETRY = {"40P01", "40001"}


# -- dialects ------------------------------------------------------------------------------


def _dialect(bind: Dialect | Connection | Engine) -> Dialect:
    return bind if isinstance(bind, Dialect) else bind.dialect


def dialect_family(bind: Dialect | Connection | Engine) -> Family | None:
    """The statement family of ``bind``'s database (a dialect, connection or engine),
    or None for a database msgpatterns has no statements for."""
    return _FAMILIES.get(_dialect(bind).name)


def family(bind: Dialect | Connection | Engine, *, what: str = "msgpatterns") -> Family:
    """:func:`dialect_family`, or a :class:`ConfigurationError` naming ``what`` for a
    database without one."""
    found = dialect_family(bind)
    if found is None:
        raise ConfigurationError(
            f"{what} supports PostgreSQL, SQLite, MySQL and MariaDB, "
            f"not {_dialect(bind).name!r}"
        )
    return found


def is_mysql(bind: Dialect | Connection | Engine) -> bool:
    """True on MySQL and MariaDB."""
    return dialect_family(bind) == "mysql"


# -- errors --------------------------------------------------------------------------------


def transient_errors(
    dialect: Dialect | None = None,
) -> tuple[type[BaseException], ...]:
    """The errors worth retrying: the connection was lost, refused or timed out.

    SQLAlchemy's ``OperationalError``, ``InterfaceError``, ``DisconnectionError`` and
    ``TimeoutError`` (pool); with ``dialect`` also its driver's own
    ``OperationalError`` and ``InterfaceError``, which a few driver calls SQLAlchemy
    makes outside statements raise unwrapped (setting autocommit on a connection the
    server has just dropped).
    """
    errors: tuple[type[BaseException], ...] = (
        sa.exc.OperationalError, sa.exc.InterfaceError, sa.exc.DisconnectionError,
        sa.exc.TimeoutError,
    )
    if dialect is not None:
        dbapi = dialect.loaded_dbapi  # an async driver's adapter may lack one of them
        errors += tuple(kind for kind in (getattr(dbapi, "OperationalError", None),
                                          getattr(dbapi, "InterfaceError", None))
                        if isinstance(kind, type))
    return errors


def _sqlstate(exc: sa.exc.DBAPIError) -> str | None:
    """The SQLSTATE of a driver error (psycopg 3 and PyMySQL ``sqlstate``, psycopg2
    ``pgcode``), if the driver reports one."""
    state = getattr(exc.orig, "pgcode", None) or getattr(exc.orig, "sqlstate", None)
    return state if isinstance(state, str) else None


def _errno(exc: sa.exc.DBAPIError) -> int | None:
    """The MySQL/MariaDB error number of a driver error."""
    args = getattr(exc.orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def is_deadlock(exc: sa.exc.DBAPIError) -> bool:
    """True when the database rolled the transaction back for a deadlock or a
    serialization failure: running it again in a new transaction is the fix."""
    return _sqlstate(exc) in _SQLSTATE_RETRY or _errno(exc) in _MYSQL_DEADLOCK


def is_duplicate_key(exc: sa.exc.DBAPIError) -> bool:
    """True for MySQL/MariaDB's duplicate primary or unique key errors."""
    return _errno(exc) in _DUPLICATE_KEY


# -- schema --------------------------------------------------------------------------------


class OnFirstUse:
    """Runs ``action`` on the first call only (thread-safe: concurrent first calls run
    it once; one that raises leaves it to the next call), until :meth:`reset`. How a
    part creates its table once per process: ``OnFirstUse(lambda: create_table(...))``.
    """

    def __init__(self, action: Callable[[], object]) -> None:
        self._action = action
        self._lock = threading.Lock()
        self.done = False

    def __call__(self) -> None:
        if self.done:
            return
        with self._lock:
            if not self.done:
                self._action()
                self.done = True

    def reset(self) -> None:
        """Run ``action`` again on the next call (after the table was dropped)."""
        self.done = False


def create_table(engine: Engine, table: sa.Table) -> bool:
    """Create ``table`` (with its indexes) unless it exists; True when this call
    created it.

    Safe to race: when another process creates it between the check and the CREATE,
    the CREATE's error is swallowed and the call returns False; any other error
    (no privilege, a bad definition) propagates.
    """
    if sa.inspect(engine).has_table(table.name, schema=table.schema):
        return False
    try:
        table.create(engine)
    except sa.exc.DBAPIError:
        if not sa.inspect(engine).has_table(table.name, schema=table.schema):
            raise  # not a race with another process creating it
        return False
    return True


# -- statements ----------------------------------------------------------------------------


def insert_if_absent(
    conn: Connection,
    table: sa.Table,
    keys: Sequence[sa.Column[Any]],
    row: Mapping[str, Any],
    dialect: Family | None = None,
) -> bool:
    """Insert ``row`` unless a row with its key (``keys``) exists; True if it inserted.

    Any other integrity error (a NOT NULL column, another unique key) propagates.
    ``dialect`` defaults to ``conn``'s :func:`family`.
    """
    dialect = dialect or family(conn)
    if dialect != "mysql":
        stmt = postgresql.insert(table) if dialect == "postgresql" else sqlite.insert(table)
        absent = stmt.values(dict(row)).on_conflict_do_nothing(index_elements=keys)
        return conn.execute(absent.execution_options(preserve_rowcount=True)).rowcount == 1
    # MySQL rolls back only the failed statement, never the transaction; and unlike
    # INSERT IGNORE this does not turn other errors into warnings.
    try:
        conn.execute(sa.insert(table).values(dict(row)))
    except sa.exc.IntegrityError as exc:
        if not is_duplicate_key(exc):
            raise
        # A locking read sees the row another transaction just committed; a plain read
        # under REPEATABLE READ would see this transaction's older snapshot.
        match = sa.and_(*(c == row[c.key] for c in keys))
        current = sa.select(keys[0]).where(match).with_for_update(read=True)
        if conn.execute(current).first() is None:
            raise  # a different unique key clashed
        return False
    return True
