"""VersionGuard.upsert_latest_many on PostgreSQL with psycopg 3: batches go by COPY into
a staging table plus one INSERT ... SELECT ... ON CONFLICT DO UPDATE WHERE older."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import JSON, Column, Engine, Integer, String, Table, select

import msgpatterns.ordering.version_guard as version_guard_module
from msgpatterns.ordering import VersionGuard
from msgpatterns.ordering.version_guard import COPY_MIN_ROWS
from ordering_db import engine_for, temp_table

pytestmark = pytest.mark.postgres

N = COPY_MIN_ROWS + 50


@pytest.fixture
def engine(postgres_url: str) -> Iterator[Engine]:
    assert postgres_url.startswith("postgresql+psycopg://")
    with engine_for(postgres_url) as engine:
        yield engine


@pytest.fixture
def orders(engine: Engine) -> Iterator[Table]:
    with temp_table(
        engine, "copy_orders",
        Column("id", String(64), primary_key=True),
        Column("state", String(32)),
        Column("doc", JSON),
        Column("version", Integer),
    ) as table:
        yield table


@pytest.fixture
def staged(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Rows handed to the COPY path, per call (proves which path ran)."""
    calls: list[int] = []
    real = version_guard_module.stage_rows

    def spy(conn: Any, table: Any, columns: Any, rows: Any) -> Any:
        calls.append(len(rows))
        return real(conn, table, columns, rows)

    monkeypatch.setattr(version_guard_module, "stage_rows", spy)
    return calls


def _rows(engine: Engine, table: Table) -> dict[str, tuple[Any, ...]]:
    with engine.connect() as conn:
        return {r.id: (r.state, r.doc, r.version) for r in conn.execute(select(table))}


def _batch(version: int, state: str, n: int = N) -> list[dict[str, Any]]:
    return [{"id": f"k{i:04d}", "state": state, "doc": {"v": version, "tags": [i]},
             "version": version} for i in range(n)]


def test_a_large_batch_goes_by_copy_and_never_overwrites_newer_rows(
    engine: Engine, orders: Table, staged: list[int],
) -> None:
    guard = VersionGuard(orders, "id", "version")
    with engine.begin() as conn:
        conn.execute(orders.insert(), [
            {"id": "k0000", "state": "newer", "doc": None, "version": 9},
            {"id": "k0001", "state": "older", "doc": None, "version": 1},
            {"id": "k0002", "state": "no version", "doc": None, "version": None},
            {"id": "k0003", "state": "same", "doc": None, "version": 5},
        ])
    batch = _batch(5, "new")
    # duplicates of one key in the batch: the newest wins, the first of equals
    batch += [{"id": "k0001", "state": "stale dup", "doc": None, "version": 4},
              {"id": "k0004", "state": "newest dup", "doc": {"x": 1}, "version": 6},
              {"id": "k0004", "state": "equal dup", "doc": None, "version": 6}]
    with engine.begin() as conn:
        written = guard.upsert_latest_many(conn, batch)
    assert staged == [N]
    assert written == N - 2  # k0000 holds a newer version, k0003 the same one
    stored = _rows(engine, orders)
    assert stored["k0000"] == ("newer", None, 9)
    assert stored["k0003"] == ("same", None, 5)
    assert stored["k0001"] == ("new", {"v": 5, "tags": [1]}, 5)
    assert stored["k0002"] == ("new", {"v": 5, "tags": [2]}, 5)  # NULL counts as older
    assert stored["k0004"] == ("newest dup", {"x": 1}, 6)
    assert len(stored) == N

    with engine.begin() as conn:  # a replay writes nothing
        assert guard.upsert_latest_many(conn, batch) == 0


def test_the_copy_stays_inside_the_callers_transaction(
    engine: Engine, orders: Table, staged: list[int],
) -> None:
    guard = VersionGuard(orders, "id", "version")
    with engine.connect() as conn:
        with conn.begin() as transaction:
            assert guard.upsert_latest_many(conn, _batch(1, "a")) == N
            # a second batch in the same transaction sees none of the first one's
            # staging rows: its count is exact
            assert guard.upsert_latest_many(conn, _batch(2, "b", N - 10)) == N - 10
            transaction.rollback()
        assert _rows(engine, orders) == {}
        # the connection is usable after the rollback (the staging table is re-made)
        with conn.begin():
            assert guard.upsert_latest_many(conn, _batch(3, "c")) == N
    assert len(_rows(engine, orders)) == N
    assert staged == [N, N - 10, N]


def test_a_connection_without_an_explicit_transaction_commits_with_the_caller(
    engine: Engine, orders: Table, staged: list[int],
) -> None:
    guard = VersionGuard(orders, "id", "version")
    with engine.connect() as conn:  # autobegin: the caller commits
        assert guard.upsert_latest_many(conn, _batch(1, "a")) == N
        conn.commit()
    with engine.connect() as conn:
        conn = conn.execution_options(isolation_level="AUTOCOMMIT")
        assert guard.upsert_latest_many(conn, _batch(2, "b")) == N
    assert {v[2] for v in _rows(engine, orders).values()} == {2}
    assert guard.upsert_latest_many(engine, _batch(3, "c")) == N  # an Engine
    assert {v[2] for v in _rows(engine, orders).values()} == {3}
    assert staged == [N, N, N]


def test_small_batches_stay_on_executemany(
    engine: Engine, orders: Table, staged: list[int],
) -> None:
    guard = VersionGuard(orders, "id", "version")
    assert guard.upsert_latest_many(engine, _batch(1, "a", COPY_MIN_ROWS - 1)) == \
        COPY_MIN_ROWS - 1
    assert staged == []


def test_composite_keys_by_copy(engine: Engine, staged: list[int]) -> None:
    with temp_table(
        engine, "copy_lines",
        Column("order_id", String(16), primary_key=True),
        Column("line", Integer, primary_key=True),
        Column("qty", Integer),
        Column("version", Integer),
    ) as lines:
        guard = VersionGuard(lines, ["order_id", "line"], "version")
        rows = [{"order_id": f"o{i % 7}", "line": i, "qty": i, "version": 2} for i in range(N)]
        assert guard.upsert_latest_many(engine, rows) == N
        older = [{**row, "qty": -1, "version": 1} for row in rows]
        assert guard.upsert_latest_many(engine, older) == 0
        with engine.connect() as conn:
            assert conn.execute(select(lines.c.qty).where(lines.c.qty < 0)).first() is None
    assert staged == [N, N]
