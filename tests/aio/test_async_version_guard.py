"""AsyncVersionGuard beyond the rules it shares with VersionGuard, on SQLite
(aiosqlite), the real PostgreSQL (psycopg 3 async) and the real MariaDB (aiomysql):
sync and async writers on one table, concurrent tasks, misuse. The rules themselves
(strict transitions, latest wins, batches, transactions) are checked on both APIs by
one parametrized suite: tests/test_ordering_version_guard.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, Table, select
from sqlalchemy.ext.asyncio import AsyncEngine

from msgpatterns import NeedRetry
from msgpatterns.aio import AsyncVersionGuard
from msgpatterns.errors import ConfigurationError
from msgpatterns.ordering import VersionGuard
from ordering_db import orders_table

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

@pytest.fixture
def orders(engine: Engine) -> Iterator[Table]:
    with orders_table(engine, "avg_orders") as table:
        yield table


def rows(engine: Engine, table: Table) -> dict[Any, tuple[Any, ...]]:
    with engine.connect() as conn:
        return {row[0]: tuple(row[1:]) for row in conn.execute(select(table))}


# -- what only the async guard has ------------------------------------------------------


async def test_sync_and_async_writers_share_one_table(
    engine: Engine, aengine: AsyncEngine, orders: Table
) -> None:
    sync_guard = VersionGuard(orders, "id", "version")
    async_guard = AsyncVersionGuard(orders, "id", "version")
    assert await async_guard.apply(aengine, "s", None, 0, {"state": "async"})
    with engine.begin() as conn:
        assert sync_guard.apply(conn, "s", 0, 1, {"state": "sync"})
    assert await async_guard.apply(aengine, "s", 0, 1, {"state": "dup"}) is False
    assert await async_guard.upsert_latest(aengine, "s", 2, {"state": "async 2"})
    assert rows(engine, orders) == {"s": ("async 2", 2)}


async def test_concurrent_async_writers_keep_the_newest_version(
    aengine: AsyncEngine, engine: Engine, orders: Table
) -> None:
    guard = AsyncVersionGuard(orders, "id", "version")

    async def write(version: int) -> None:
        for _ in range(20):  # a deadlock between creators is a "not now": run it again
            try:
                await guard.upsert_latest(aengine, "hot", version, {"state": f"v{version}"})
                return
            except NeedRetry:
                await asyncio.sleep(0)
        raise AssertionError("still deadlocking after 20 attempts")

    await asyncio.gather(*(write(v) for v in [3, 9, 1, 7, 5, 8, 2, 6, 4]))
    assert rows(engine, orders) == {"hot": ("v9", 9)}


# -- misuse -----------------------------------------------------------------------------


async def test_a_sync_connection_or_anything_else_is_refused(
    engine: Engine, orders: Table
) -> None:
    guard = AsyncVersionGuard(orders, "id", "version")
    with engine.connect() as conn, pytest.raises(ConfigurationError, match="VersionGuard"):
        await guard.apply(conn, "x", None, 0)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="AsyncConnection"):
        await guard.upsert_latest("not a connection", "x", 1)  # type: ignore[arg-type]


