"""SqlSink: a Flusher processor that inserts a batch by COPY on PostgreSQL (psycopg 3)
and by one executemany elsewhere."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from sqlalchemy import JSON, Column, Engine, Integer, String, Table, exc, select

import msgpatterns.sql_sink as sql_sink_module
from msgpatterns import Flusher
from msgpatterns.errors import ConfigurationError
from msgpatterns.sql_sink import SqlSink
from ordering_db import engine_for, temp_table


@pytest.fixture
def engine(sql_url: str) -> Iterator[Engine]:
    with engine_for(sql_url) as engine:
        yield engine


@pytest.fixture
def orders(engine: Engine) -> Iterator[Table]:
    with temp_table(
        engine, "sink_orders",
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("key", String(64), nullable=False),
        Column("doc", JSON),
    ) as table:
        yield table


@pytest.fixture
def copies(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The COPY statements sent (proves which path ran)."""
    sent: list[str] = []
    real = sql_sink_module._copy

    def spy(conn: Any, raw: Any, target: str, columns: str, rows: Any) -> None:
        sent.append(target)
        real(conn, raw, target, columns, rows)

    monkeypatch.setattr(sql_sink_module, "_copy", spy)
    return sent


def _stored(engine: Engine, table: Table) -> dict[int, tuple[Any, ...]]:
    with engine.connect() as conn:
        return {r.id: (r.key, r.doc) for r in conn.execute(select(table))}


def _rows(start: int, stop: int) -> list[dict[str, Any]]:
    return [{"id": i, "key": f"order-{i}", "doc": {"n": i}} for i in range(start, stop)]


def test_a_flusher_with_a_sql_sink_writes_every_row(
    engine: Engine, orders: Table, copies: list[str],
) -> None:
    with Flusher("sink", 50, 0.01, 1000, 2, SqlSink(engine, orders)) as flusher:
        for row in _rows(0, 230):
            assert flusher.add(row, timeout=5)
    assert flusher.counters.errors == 0
    assert _stored(engine, orders) == {i: (f"order-{i}", {"n": i}) for i in range(230)}
    on_copy = engine.dialect.name == "postgresql"
    assert len(copies) == (flusher.counters.batches if on_copy else 0)


def test_a_duplicate_fails_the_batch_unless_conflicts_are_ignored(
    engine: Engine, orders: Table, copies: list[str],
) -> None:
    SqlSink(engine, orders)(_rows(0, 10))
    with pytest.raises(exc.IntegrityError):
        SqlSink(engine, orders)(_rows(5, 15))
    assert len(_stored(engine, orders)) == 10  # nothing of the failed batch

    ignoring = SqlSink(engine, orders, on_conflict="ignore",
                       row=lambda item: {**item, "key": item["key"].upper()})
    ignoring(_rows(5, 15) + _rows(14, 16))  # a redelivery, and a duplicate in the batch
    stored = _stored(engine, orders)
    assert len(stored) == 16
    assert stored[5] == ("order-5", {"n": 5})        # existing rows are left alone
    assert stored[12] == ("ORDER-12", {"n": 12})     # new ones are written
    if engine.dialect.name == "postgresql":
        assert copies[-1].startswith("pg_temp.")     # COPY into the staging table


def test_write_runs_in_the_callers_transaction(engine: Engine, orders: Table) -> None:
    sink = SqlSink(engine, orders)
    with engine.connect() as conn, conn.begin() as transaction:
        sink.write(conn, _rows(0, 20))
        assert conn.execute(select(orders.c.id)).all() != []
        transaction.rollback()
    assert _stored(engine, orders) == {}


@pytest.mark.parametrize("sql_url", ["sqlite"], indirect=True)
def test_mistakes_are_refused_at_construction(engine: Engine, orders: Table) -> None:
    with pytest.raises(ConfigurationError, match="engine"):
        SqlSink("sqlite://", orders)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="table"):
        SqlSink(engine, "orders")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="on_conflict"):
        SqlSink(engine, orders, on_conflict="update")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="no columns"):
        SqlSink(engine, orders)([{"id": 1, "key": "k", "price": 3}])
