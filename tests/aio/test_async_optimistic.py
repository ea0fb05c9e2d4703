"""async_optimistic_update beyond the rules it shares with optimistic_update (those run
on both APIs in tests/test_ordering_optimistic.py): misuse refused, and tasks
contending through AsyncVersionGuard's compare-and-set on aiosqlite, the real
PostgreSQL and MariaDB."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, Table, select
from sqlalchemy.ext.asyncio import AsyncEngine

from msgpatterns import optimistic_update
from msgpatterns.aio import AsyncVersionGuard
from msgpatterns.errors import ConfigurationError
from msgpatterns.ordering import async_optimistic_update
from ordering_db import orders_table
from test_ordering_optimistic import Cell as SyncCell

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


class Cell:
    """The sync test's cell (a compare-and-set that loses ``losses`` times first),
    with coroutine ``load`` and ``save``."""

    def __init__(self, losses: int = 0) -> None:
        self.cell = SyncCell(losses)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cell, name)

    async def load(self) -> tuple[int, int]:
        await asyncio.sleep(0)
        return self.cell.load()

    async def save(self, current: tuple[int, int], merged: int) -> bool:
        await asyncio.sleep(0)
        return self.cell.save(current, merged)


def plus_one(current: tuple[int, int]) -> int:
    return current[0] + 1


def test_misuse_is_refused_before_anything_runs() -> None:
    cell = Cell()

    def sync_load() -> tuple[int, int]:
        return 0, 0

    with pytest.raises(TypeError, match="use optimistic_update"):
        async_optimistic_update(sync_load, plus_one, cell.save)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="use optimistic_update"):
        async_optimistic_update(lambda: True)  # type: ignore[arg-type, return-value]
    with pytest.raises(ConfigurationError, match="attempts"):
        async_optimistic_update(attempts=0)
    with pytest.raises(TypeError, match="async def"):
        optimistic_update(cell.load, plus_one, cell.save)  # type: ignore[arg-type]


@pytest.fixture
def counters(engine: Engine) -> Iterator[Table]:
    with orders_table(engine, "aopt") as table:
        yield table


async def test_concurrent_tasks_lose_no_update_on_a_real_database(
        engine: Engine, aengine: AsyncEngine, counters: Table) -> None:
    """Tasks adding 1 each through AsyncVersionGuard's compare-and-set: every one of
    them counts (lost rounds retried with fresh data), none is lost or doubled."""
    guard = AsyncVersionGuard(counters, counters.c.id, counters.c.version)
    assert await guard.upsert_latest(aengine, "c", 0, {"state": "0"})
    tasks = 6

    async def load() -> tuple[int, int]:
        row = await guard.read(aengine, "c")
        assert row is not None
        return int(row["state"]), int(row["version"])

    async def save(current: tuple[int, int], merged: int) -> bool:
        return await guard.compare_and_set(aengine, "c", current[1], current[1] + 1,
                                           {"state": str(merged)})

    await asyncio.gather(*(async_optimistic_update(load, plus_one, save, attempts=50)
                           for _ in range(tasks)))
    with engine.connect() as conn:
        state, version = conn.execute(select(counters.c.state, counters.c.version)).one()
    assert (int(state), version) == (tasks, tasks)
