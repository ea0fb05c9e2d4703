"""Helpers for the ordering tests: an engine per database URL and throwaway tables.

Other engineers use the same database servers at the same time, so every table gets
a unique name and is dropped afterwards. :func:`sql_side` drives a database through the
sync or the async API behind one face, for suites parametrized over both.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Literal

from anyio.from_thread import BlockingPortal, start_blocking_portal
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, Text, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from aio.async_db import async_url  # tests/aio/async_db.py
from msgpatterns.aio import AsyncVersionGuard
from msgpatterns.ordering import VersionGuard


@contextmanager
def engine_for(url: str) -> Iterator[Engine]:
    """An engine for ``url`` that tolerates a few threads writing to SQLite at once."""
    connect_args: dict[str, Any] = {"timeout": 30} if url.startswith("sqlite") else {}
    engine = create_engine(url, connect_args=connect_args, pool_size=10)
    try:
        yield engine
    finally:
        engine.dispose()


@contextmanager
def temp_table(engine: Engine, prefix: str, *columns: Any) -> Iterator[Table]:
    """Create a uniquely named table with ``columns``; drop it afterwards."""
    metadata = MetaData()
    table = Table(f"{prefix}_{uuid.uuid4().hex[:10]}", metadata, *columns)
    metadata.create_all(engine)
    try:
        yield table
    finally:
        metadata.drop_all(engine)


@contextmanager
def orders_table(engine: Engine, prefix: str) -> Iterator[Table]:
    """A throwaway ``(id primary key, state, version)`` table, VersionGuard's usual."""
    with temp_table(
        engine, prefix,
        Column("id", String(64), primary_key=True),
        Column("state", Text),
        Column("version", Integer),
    ) as table:
        yield table


# -- one test body, the sync and the async API -------------------------------------------

Mode = Literal["sync", "async"]
MODES: list[Mode] = ["sync", "async"]


class GuardFace:
    """A :class:`VersionGuard` or an :class:`AsyncVersionGuard` behind the sync guard's
    signatures: the async guard's coroutines run on the side's event loop (in its own
    thread) and the calling thread waits for their results; ``conn`` is whatever the
    side's :meth:`SqlSide.begin` gave (a ``Connection`` or an ``AsyncConnection``)."""

    def __init__(self, side: SqlSide, guard: Any) -> None:
        self.side, self.guard = side, guard

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.guard, name)
        if self.side.portal is None or not callable(method):
            return method
        portal = self.side.portal
        return lambda *args: portal.call(method, *args)


class SqlSide:
    """One database driven through the sync API (``Engine``, ``VersionGuard``) or the
    async one (``AsyncEngine`` on psycopg 3 async, aiosqlite or aiomysql,
    ``AsyncVersionGuard``), both behind the sync signatures, so that one test body
    checks both. ``engine`` is always a sync Engine on the same database, for setting
    up and checking; any thread may call the faces (the async side's loop runs in an
    anyio blocking portal)."""

    def __init__(self, mode: Mode, engine: Engine, portal: BlockingPortal | None = None,
                 aengine: AsyncEngine | None = None) -> None:
        self.mode, self.engine, self.portal, self.aengine = mode, engine, portal, aengine

    def guard(self, table: Table, key: Any, version: Any) -> Any:
        """A guard on ``table`` with the sync guard's signatures."""
        if self.portal is None:
            return VersionGuard(table, key, version)
        return GuardFace(self, AsyncVersionGuard(table, key, version))

    def begin(self) -> AbstractContextManager[Any]:
        """A connection in a transaction: committed at the end, rolled back on an error."""
        if self.portal is None:
            return self.engine.begin()
        assert self.aengine is not None
        return self.portal.wrap_async_context_manager(self.aengine.begin())

    def connect(self) -> AbstractContextManager[Any]:
        """A connection (autobegin: a transaction per block, rolled back unless committed)."""
        if self.portal is None:
            return self.engine.connect()
        assert self.aengine is not None
        return self.portal.wrap_async_context_manager(self.aengine.connect())

    def execute(self, conn: Any, statement: Any, parameters: Any = None) -> Any:
        """``conn.execute(statement, parameters)`` (awaited on the async side)."""
        if self.portal is None:
            return conn.execute(statement, parameters)
        return self.portal.call(conn.execute, statement, parameters)

    def commit(self, conn: Any) -> None:
        """Commit ``conn``'s transaction (from :meth:`connect`)."""
        if self.portal is None:
            conn.commit()
        else:
            self.portal.call(conn.commit)

    @property
    def bind(self) -> Any:
        """The (async) engine itself: a guard call given it runs in a transaction of its own."""
        return self.engine if self.portal is None else self.aengine


@contextmanager
def sql_side(mode: Mode, engine: Engine) -> Iterator[SqlSide]:
    """A :class:`SqlSide` of ``mode`` on ``engine``'s database."""
    if mode == "sync":
        yield SqlSide(mode, engine)
        return
    url = engine.url.render_as_string(hide_password=False)
    connect_args: dict[str, Any] = {"timeout": 30} if url.startswith("sqlite") else {}
    aengine = create_async_engine(async_url(url), connect_args=connect_args, pool_size=10)
    with start_blocking_portal("asyncio") as portal:
        try:
            yield SqlSide(mode, engine, portal, aengine)
        finally:
            portal.call(aengine.dispose)
