"""VersionGuard's rules, sync and async (issue 12 item 4): the same outcomes from
``VersionGuard`` on a ``Connection``/``Engine`` and from ``AsyncVersionGuard`` on an
``AsyncConnection``/``AsyncEngine``, on SQLite (aiosqlite), the real PostgreSQL
(psycopg 3 async) and the real MariaDB (aiomysql)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from sqlalchemy import Engine, Table, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from msgpatterns import NeedRetry
from msgpatterns.aio import AsyncVersionGuard
from msgpatterns.errors import ConfigurationError, MalformedMessage
from msgpatterns.ordering import InvalidVersion, MissingVersion, VersionConflict, VersionGuard
from ordering_db import orders_table

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

Mode = Literal["sync", "async"]
MODES: list[Mode] = ["sync", "async"]


@pytest.fixture
def orders(engine: Engine) -> Iterator[Table]:
    with orders_table(engine, "avg_orders") as table:
        yield table


class Guard:
    """One guard driven sync or async: ``await g.call(op, *args)`` runs ``op`` in a
    transaction of its own (``engine.begin()`` / ``async with aengine.begin()``)."""

    def __init__(self, mode: Mode, table: Table, engine: Engine, aengine: AsyncEngine) -> None:
        self.mode = mode
        self.sync = VersionGuard(table, "id", "version")
        self.aio = AsyncVersionGuard(table, "id", "version")
        self.engine = engine
        self.aengine = aengine

    async def call(self, op: str, *args: Any) -> Any:
        if self.mode == "sync":
            with self.engine.begin() as conn:
                return getattr(self.sync, op)(conn, *args)
        async with self.aengine.begin() as aconn:
            return await getattr(self.aio, op)(aconn, *args)

    async def on_engine(self, op: str, *args: Any) -> Any:
        """``op`` given the (async) engine itself: one transaction per call."""
        if self.mode == "sync":
            return getattr(self.sync, op)(self.engine, *args)
        return await getattr(self.aio, op)(self.aengine, *args)


@pytest.fixture(params=MODES)
def guard(request: pytest.FixtureRequest, orders: Table, engine: Engine,
          aengine: AsyncEngine) -> Guard:
    return Guard(request.param, orders, engine, aengine)


def rows(engine: Engine, table: Table) -> dict[Any, tuple[Any, ...]]:
    with engine.connect() as conn:
        return {row[0]: tuple(row[1:]) for row in conn.execute(select(table))}


# -- strict transitions -----------------------------------------------------------------


async def test_apply_follows_the_chain_skips_duplicates_and_tolerates_gaps(
    guard: Guard, engine: Engine, orders: Table
) -> None:
    steps = [
        ((None, 0, {"state": "new"}), True),
        ((None, 0, {"state": "new again"}), False),
        ((0, 1, {"state": "paid"}), True),
        ((0, 1, {"state": "paid twice"}), False),
        ((1, 5, {"state": "refunding"}), True),
        ((5, 9, {"state": "refunded"}), True),
        ((1, 5, {"state": "late duplicate"}), False),
    ]
    for (expected, new, values), applied in steps:
        assert await guard.call("apply", "o1", expected, new, values) is applied, new
    assert rows(engine, orders) == {"o1": ("refunded", 9)}


async def test_apply_refuses_early_moved_and_malformed_messages(
    guard: Guard, engine: Engine, orders: Table
) -> None:
    with pytest.raises(NeedRetry, match="waiting for 0"):
        await guard.call("apply", "o2", 0, 1, {"state": "paid"})  # no row yet
    assert await guard.call("apply", "o2", None, 0, {"state": "new"})
    assert await guard.call("apply", "o2", 0, 3, {"state": "moved"})
    with pytest.raises(VersionConflict):
        await guard.call("apply", "o2", 1, 4, {"state": "never"})  # at 3: past 1, before 4
    with pytest.raises(NeedRetry):
        await guard.call("apply", "o2", 5, 6, {"state": "early"})
    with pytest.raises(MissingVersion):
        await guard.call("apply", "o2", 3, None)
    with pytest.raises(InvalidVersion):
        await guard.call("apply", "o2", 3, 2)
    with pytest.raises(MalformedMessage):
        await guard.call("apply", "", None, 0)
    with pytest.raises(ConfigurationError, match="key or version"):
        await guard.call("apply", "o2", 3, 4, {"version": 7})
    assert rows(engine, orders) == {"o2": ("moved", 3)}


async def test_compare_and_set_read_and_stored_version(guard: Guard) -> None:
    assert await guard.call("read", "o3") is None
    assert await guard.call("stored_version", "o3") is None
    assert await guard.call("compare_and_set", "o3", None, 1, {"state": "a"}) is True
    assert await guard.call("compare_and_set", "o3", None, 1, {"state": "b"}) is False
    assert await guard.call("compare_and_set", "o3", 0, 2, {"state": "c"}) is False
    assert await guard.call("compare_and_set", "o3", 1, 2, {"state": "d"}) is True
    row = await guard.call("read", "o3")
    assert (row["id"], row["state"], row["version"]) == ("o3", "d", 2)
    assert await guard.call("stored_version", "o3") == 2


# -- latest wins ------------------------------------------------------------------------


async def test_upsert_latest_never_lets_an_older_version_overwrite(
    guard: Guard, engine: Engine, orders: Table
) -> None:
    assert await guard.call("upsert_latest", "k", 5, {"state": "v5"}) is True
    assert await guard.call("upsert_latest", "k", 3, {"state": "v3"}) is False
    assert await guard.call("upsert_latest", "k", 5, {"state": "v5 again"}) is False
    assert await guard.call("upsert_latest", "k", 8, {"state": "v8"}) is True
    with pytest.raises(MissingVersion):
        await guard.call("upsert_latest", "k", None, {"state": "none"})
    assert rows(engine, orders) == {"k": ("v8", 8)}


async def test_upsert_latest_many_collapses_per_key_and_counts_rows_written(
    guard: Guard, engine: Engine, orders: Table
) -> None:
    assert await guard.call("upsert_latest", "b", 10, {"state": "b10"})
    batch = [
        {"id": "a", "state": "a1", "version": 1},
        {"id": "a", "state": "a3", "version": 3},
        {"id": "a", "state": "a2", "version": 2},
        {"id": "b", "state": "b4", "version": 4},  # older than stored: not written
        {"id": "c", "state": "c1", "version": 1},
    ]
    assert await guard.call("upsert_latest_many", batch) == 2
    assert await guard.call("upsert_latest_many", []) == 0
    assert rows(engine, orders) == {"a": ("a3", 3), "b": ("b10", 10), "c": ("c1", 1)}


async def test_a_large_batch_writes_every_row(guard: Guard, engine: Engine,
                                              orders: Table) -> None:
    """From COPY_MIN_ROWS rows PostgreSQL's sync path goes by COPY; the async one by
    executemany: both write the same."""
    batch = [{"id": f"r{i:03}", "state": str(i), "version": i} for i in range(150)]
    assert await guard.call("upsert_latest_many", batch) == 150
    newer = [{**row, "version": row["version"] + 1, "state": "new"} for row in batch[::2]]
    assert await guard.call("upsert_latest_many", newer + batch[1::2]) == 75
    stored = rows(engine, orders)
    assert len(stored) == 150
    assert sum(1 for state, _ in stored.values() if state == "new") == 75


# -- transactions -----------------------------------------------------------------------


async def test_an_engine_call_commits_on_its_own(guard: Guard, engine: Engine,
                                                 orders: Table) -> None:
    assert await guard.on_engine("upsert_latest", "e", 1, {"state": "one"}) is True
    assert await guard.on_engine("apply", "e", 1, 2, {"state": "two"}) is True
    assert rows(engine, orders) == {"e": ("two", 2)}
    assert await guard.on_engine("stored_version", "e") == 2


async def test_the_write_rolls_back_with_the_callers_transaction(
    engine: Engine, aengine: AsyncEngine, orders: Table
) -> None:
    guard = AsyncVersionGuard(orders, "id", "version")
    seen: list[Any] = []

    async def handler() -> None:
        async with aengine.begin() as aconn:
            assert await guard.apply(aconn, "t", None, 0, {"state": "created"})
            seen.append(await guard.stored_version(aconn, "t"))  # visible in it
            raise RuntimeError("handler failed after the write")

    with pytest.raises(RuntimeError, match="handler failed"):
        await handler()
    assert seen == [0]
    assert rows(engine, orders) == {}


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


def test_bad_columns_are_refused_as_in_the_sync_guard(orders: Table) -> None:
    with pytest.raises(ConfigurationError, match="no column"):
        AsyncVersionGuard(orders, "nope", "version")
    with pytest.raises(ConfigurationError, match="Table"):
        AsyncVersionGuard("orders", "id", "version")  # type: ignore[arg-type]


async def test_an_async_connection_keeps_its_own_transaction(
    aengine: AsyncEngine, engine: Engine, orders: Table
) -> None:
    """Several calls on one AsyncConnection are one transaction: committed together."""
    guard = AsyncVersionGuard(orders, "id", "version")
    aconn: AsyncConnection
    async with aengine.connect() as aconn:
        assert await guard.apply(aconn, "m", None, 0, {"state": "a"})
        assert await guard.apply(aconn, "m", 0, 1, {"state": "b"})
        assert rows(engine, orders) == {}  # not committed yet
        await aconn.commit()
    assert rows(engine, orders) == {"m": ("b", 1)}
