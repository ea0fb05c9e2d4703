"""AsyncVersionGuard: :class:`~msgpatterns.ordering.VersionGuard` on SQLAlchemy's
``AsyncConnection`` / ``AsyncEngine``.

Every operation is the sync guard's own method run through
:meth:`AsyncConnection.run_sync <sqlalchemy.ext.asyncio.AsyncConnection.run_sync>`:
the decisions (strict transitions, latest wins, the MySQL paths, deadlocks as
:class:`~msgpatterns.errors.NeedRetry`, malformed keys and versions) and the statements
(:mod:`msgpatterns.ordering.statements`) exist once. Only the I/O differs: each
statement is sent by the async driver (psycopg 3's async connection, aiosqlite,
aiomysql or asyncmy) and awaited on the event loop, which is never blocked.

Needs the ``sql`` extra plus an async driver and greenlet (SQLAlchemy's asyncio
bridge): ``postgresql+psycopg://`` (psycopg 3 serves both), ``sqlite+aiosqlite://``,
``mysql+aiomysql://`` or ``mysql+asyncmy://``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Concatenate, ParamSpec, Self, TypeVar

from msgpatterns._extras import require
from msgpatterns.errors import ClosedError, ConfigurationError
from msgpatterns.ordering.version_guard import ColumnRef, VersionGuard

require("sqlalchemy", "sql")

from sqlalchemy import Connection, RowMapping, Table  # noqa: E402
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine  # noqa: E402

__all__ = ["AsyncVersionGuard"]

P = ParamSpec("P")
R = TypeVar("R")

AsyncBind = AsyncConnection | AsyncEngine


async def run_on(
    conn: AsyncBind,
    what: str,
    method: Callable[Concatenate[Connection, P], R],
    /,
    *args: P.args,
    **kwargs: P.kwargs,
) -> R:
    """Run the sync ``method(connection, ...)`` on ``conn``: an ``AsyncConnection`` (in
    its transaction) or an ``AsyncEngine`` (a transaction of its own, committed when it
    returns, rolled back when it raises). Anything else is a
    :class:`~msgpatterns.errors.ConfigurationError` naming ``what``."""
    if isinstance(conn, AsyncConnection):
        return await conn.run_sync(method, *args, **kwargs)
    if isinstance(conn, AsyncEngine):
        async with conn.begin() as transaction:
            return await transaction.run_sync(method, *args, **kwargs)
    if isinstance(conn, Connection):
        hint = "; for a sync Connection use msgpatterns.ordering.VersionGuard"
    elif hasattr(conn, "connection"):
        hint = " (with an AsyncSession pass `await session.connection()`)"
    else:
        hint = ""
    raise ConfigurationError(
        f"{what}: conn must be a SQLAlchemy AsyncConnection (your transaction: `async with "
        f"engine.begin() as conn`) or an AsyncEngine (one transaction per call), got "
        f"{type(conn).__name__}{hint}"
    )


class AsyncVersionGuard:
    """The operations of :class:`~msgpatterns.ordering.VersionGuard`, awaited.

    Built with the same arguments (``table``, ``key``, ``version``; the same
    :class:`~msgpatterns.errors.ConfigurationError` for bad ones). Each method takes
    ``conn``: an ``AsyncConnection`` (the statements run in your transaction, so the
    guarded write commits with your other effects) or an ``AsyncEngine`` (a
    transaction of its own per call). Results, exceptions and guarantees are those of
    the sync method of the same name; :attr:`sync` is the sync guard itself, for
    the sync half of an application.

    ``upsert_latest_many`` always takes the executemany path here: the COPY path of
    PostgreSQL needs psycopg's sync connection.

    ``async with guard:`` closes it at the block's end (:meth:`aclose`); afterwards
    every method raises :class:`~msgpatterns.errors.ClosedError` before touching
    ``conn``.
    """

    def __init__(
        self, table: Table, key: ColumnRef | Sequence[ColumnRef], version: ColumnRef
    ) -> None:
        self.sync = VersionGuard(table, key, version)

    @property
    def table(self) -> Table:
        return self.sync.table

    @property
    def closed(self) -> bool:
        """True once :meth:`aclose` (or the sync guard's ``close()``) was called."""
        return self.sync.closed

    async def aclose(self) -> None:
        """Close the guard (and :attr:`sync`, the same guard); afterwards every method
        raises :class:`~msgpatterns.errors.ClosedError`. Idempotent; the connections
        and engines the calls were given stay open."""
        self.sync.close()

    async def __aenter__(self) -> Self:
        """``async with guard:`` - the block's end awaits :meth:`aclose`."""
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _open(self, what: str) -> VersionGuard:
        """The sync guard, or ClosedError before any I/O once closed."""
        if self.sync.closed:
            raise ClosedError(f"AsyncVersionGuard.{what}: the guard of "
                              f"{self.sync.table.name!r} is closed")
        return self.sync

    async def read(self, conn: AsyncBind, key: Any) -> RowMapping | None:
        """See :meth:`VersionGuard.read <msgpatterns.ordering.VersionGuard.read>`."""
        return await run_on(conn, "AsyncVersionGuard.read", self._open("read").read, key)

    async def stored_version(self, conn: AsyncBind, key: Any) -> Any:
        """See :meth:`VersionGuard.stored_version
        <msgpatterns.ordering.VersionGuard.stored_version>`."""
        return await run_on(conn, "AsyncVersionGuard.stored_version",
                            self._open("stored_version").stored_version, key)

    async def compare_and_set(
        self, conn: AsyncBind, key: Any, expected: Any, new: Any,
        values: Mapping[str, Any] | None = None,
    ) -> bool:
        """See :meth:`VersionGuard.compare_and_set
        <msgpatterns.ordering.VersionGuard.compare_and_set>`."""
        return await run_on(conn, "AsyncVersionGuard.compare_and_set",
                            self._open("compare_and_set").compare_and_set, key, expected,
                            new, values)

    async def apply(
        self, conn: AsyncBind, key: Any, expected: Any, new: Any,
        values: Mapping[str, Any] | None = None,
    ) -> bool:
        """See :meth:`VersionGuard.apply <msgpatterns.ordering.VersionGuard.apply>`."""
        return await run_on(conn, "AsyncVersionGuard.apply",
                            self._open("apply").apply, key, expected, new, values)

    async def upsert_latest(
        self, conn: AsyncBind, key: Any, version: Any, values: Mapping[str, Any] | None = None,
    ) -> bool:
        """See :meth:`VersionGuard.upsert_latest
        <msgpatterns.ordering.VersionGuard.upsert_latest>`."""
        return await run_on(conn, "AsyncVersionGuard.upsert_latest",
                            self._open("upsert_latest").upsert_latest, key, version, values)

    async def upsert_latest_many(
        self, conn: AsyncBind, rows: Iterable[Mapping[str, Any]]
    ) -> int:
        """See :meth:`VersionGuard.upsert_latest_many
        <msgpatterns.ordering.VersionGuard.upsert_latest_many>` (executemany path)."""
        return await run_on(conn, "AsyncVersionGuard.upsert_latest_many",
                            self._open("upsert_latest_many").upsert_latest_many, rows)

    def __repr__(self) -> str:
        return f"<AsyncVersionGuard {self.sync.table.name!r}>"
