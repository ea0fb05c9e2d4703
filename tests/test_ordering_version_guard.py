"""VersionGuard on SQLite, PostgreSQL and MariaDB: strict transitions and latest-wins."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import (
    Column,
    DateTime,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    UniqueConstraint,
    select,
)

import msgpatterns.ordering.version_guard as version_guard_module
from msgpatterns import Consumer, InMemoryBroker, Message, NeedRetry, RetryPolicy
from msgpatterns.errors import ConfigurationError
from msgpatterns.ordering import InvalidVersion, MissingVersion, VersionConflict, VersionGuard
from msgpatterns.testing import assert_dead_lettered
from ordering_db import engine_for, orders_table, temp_table


@pytest.fixture
def engine(sql_url: str) -> Iterator[Engine]:
    with engine_for(sql_url) as engine:
        yield engine


@pytest.fixture
def orders(engine: Engine) -> Iterator[Table]:
    with orders_table(engine, "vg_orders") as table:
        yield table


def _rows(engine: Engine, table: Table) -> dict[Any, tuple[Any, ...]]:
    with engine.connect() as conn:
        return {row[0]: tuple(row[1:]) for row in conn.execute(select(table))}


# -- apply ------------------------------------------------------------------------------


def test_apply_creates_then_follows_the_chain_and_skips_duplicates(
    engine: Engine, orders: Table
) -> None:
    guard = VersionGuard(orders, "id", "version")
    with engine.begin() as conn:
        assert guard.apply(conn, "o1", None, 0, {"state": "new"}) is True
        assert guard.apply(conn, "o1", None, 0, {"state": "new again"}) is False
        assert guard.apply(conn, "o1", 0, 1, {"state": "paid"}) is True
        assert guard.apply(conn, "o1", 0, 1, {"state": "paid twice"}) is False
        # Gaps: versions that sent no message do not matter, only old -> new links.
        assert guard.apply(conn, "o1", 1, 5, {"state": "refunding"}) is True
        assert guard.apply(conn, "o1", 5, 9, {"state": "refunded"}) is True
        assert guard.apply(conn, "o1", 1, 5, {"state": "late duplicate"}) is False
    assert _rows(engine, orders) == {"o1": ("refunded", 9)}


def test_apply_raises_need_retry_for_a_message_that_came_early(
    engine: Engine, orders: Table
) -> None:
    guard = VersionGuard(orders, "id", "version")
    with engine.begin() as conn:
        with pytest.raises(NeedRetry, match="waiting for 0"):
            guard.apply(conn, "o2", 0, 1, {"state": "paid"})  # the row does not exist yet
        guard.apply(conn, "o2", None, 0, {"state": "new"})
        with pytest.raises(NeedRetry, match="at version 0, waiting for 1"):
            guard.apply(conn, "o2", 1, 2, {"state": "refunding"})
        assert guard.apply(conn, "o2", 0, 1, {"state": "paid"})
        assert guard.apply(conn, "o2", 1, 2, {"state": "refunding"})
    assert _rows(engine, orders) == {"o2": ("refunding", 2)}


def test_apply_rejects_a_transition_that_can_never_apply(engine: Engine, orders: Table) -> None:
    guard = VersionGuard(orders, "id", "version")
    with engine.begin() as conn:
        guard.apply(conn, "o3", None, 3, {"state": "x"})
        with pytest.raises(VersionConflict, match="can never apply"):
            guard.apply(conn, "o3", 1, 4, {"state": "y"})  # 3 lies between 1 and 4
        with pytest.raises(VersionConflict):
            guard.apply(conn, "o3", None, 4, {"state": "y"})  # exists, but "create" came
    assert _rows(engine, orders) == {"o3": ("x", 3)}


def test_bad_versions_are_typed_malformed_messages(engine: Engine, orders: Table) -> None:
    guard = VersionGuard(orders, "id", "version")
    with engine.begin() as conn:
        with pytest.raises(MissingVersion):
            guard.apply(conn, "o4", 0, None)
        with pytest.raises(InvalidVersion, match="not after"):
            guard.apply(conn, "o4", 2, 2)
        with pytest.raises(InvalidVersion, match="cannot compare"):
            guard.apply(conn, "o4", "1", 2)
        with pytest.raises(MissingVersion):
            guard.upsert_latest(conn, "o4", None, {"state": "x"})
    assert _rows(engine, orders) == {}


def test_a_null_stored_version_counts_as_no_version_yet(engine: Engine, orders: Table) -> None:
    guard = VersionGuard(orders, "id", "version")
    with engine.begin() as conn:
        conn.execute(orders.insert().values(id="n1", state="legacy", version=None))
        conn.execute(orders.insert().values(id="n2", state="legacy", version=None))
        assert guard.apply(conn, "n1", None, 0, {"state": "versioned"})
        assert guard.upsert_latest(conn, "n2", 1, {"state": "versioned"})
    assert _rows(engine, orders) == {"n1": ("versioned", 0), "n2": ("versioned", 1)}


def test_keys_and_values_are_data_not_sql(engine: Engine, orders: Table) -> None:
    guard = VersionGuard(orders, "id", "version")
    nasty = "x'); DROP TABLE users; --"
    with engine.begin() as conn:
        assert guard.apply(conn, nasty, None, 1, {"state": "' OR 1=1 --"})
        assert guard.upsert_latest(conn, nasty + '"', 1, {"state": "`;"})
    assert _rows(engine, orders) == {nasty: ("' OR 1=1 --", 1), nasty + '"': ("`;", 1)}


# -- upsert_latest ------------------------------------------------------------------------


def test_upsert_latest_never_overwrites_a_newer_row(engine: Engine, orders: Table) -> None:
    guard = VersionGuard(orders, "id", "version")
    with engine.begin() as conn:
        results = [
            guard.upsert_latest(conn, "p", version, {"state": f"v{version}"})
            for version in (5, 3, 5, 7, 6, 7, 8)
        ]
    assert results == [True, False, False, True, False, False, True]
    assert _rows(engine, orders) == {"p": ("v8", 8)}


def test_upsert_latest_orders_by_timestamp_too(engine: Engine) -> None:
    with temp_table(
        engine, "vg_prices",
        Column("sku", String(32), primary_key=True),
        Column("price", Integer),
        Column("updated_at", DateTime),
    ) as prices:
        guard = VersionGuard(prices, prices.c.sku, prices.c.updated_at)
        t0 = datetime(2024, 1, 1, 12, 0, 0)
        with engine.begin() as conn:
            assert guard.upsert_latest(conn, "sku-1", t0 + timedelta(seconds=2), {"price": 2})
            assert not guard.upsert_latest(conn, "sku-1", t0, {"price": 0})
            assert guard.upsert_latest(conn, "sku-1", t0 + timedelta(seconds=3), {"price": 3})
        assert _rows(engine, prices) == {"sku-1": (3, t0 + timedelta(seconds=3))}


# -- upsert_latest_many -------------------------------------------------------------------


def test_batch_writes_only_newer_rows_and_counts_them(engine: Engine, orders: Table) -> None:
    guard = VersionGuard(orders, "id", "version")
    with engine.begin() as conn:
        guard.upsert_latest(conn, "a", 2, {"state": "a2"})
        guard.upsert_latest(conn, "b", 9, {"state": "b9"})
    batch = [
        {"id": "a", "state": "a5", "version": 5},  # newer: the values must follow
        {"id": "b", "state": "b1", "version": 1},  # older: skipped
        {"id": "c", "state": "c1", "version": 1},  # new key
        {"id": "c", "state": "c3", "version": 3},  # same key twice in one batch
        {"id": "c", "state": "c3-dup", "version": 3},  # a tie keeps the first
        {"id": "a", "state": "a4", "version": 4},
    ]
    with engine.begin() as conn:
        assert guard.upsert_latest_many(conn, batch) == 2
    # On MySQL/MariaDB a wrong assignment order (version first) would leave "a2" here.
    assert _rows(engine, orders) == {"a": ("a5", 5), "b": ("b9", 9), "c": ("c3", 3)}
    with engine.begin() as conn:
        assert guard.upsert_latest_many(conn, batch) == 0
        assert guard.upsert_latest_many(conn, []) == 0


def test_batch_splits_large_inputs_into_several_statements(
    engine: Engine, orders: Table, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(version_guard_module, "MAX_PARAMETERS", 30)  # 10 rows per statement
    guard = VersionGuard(orders, "id", "version")
    rows = [{"id": f"k{i}", "state": f"s{i}", "version": i} for i in range(45)]
    with engine.begin() as conn:
        assert guard.upsert_latest_many(conn, rows[::2]) == 23
        assert guard.upsert_latest_many(conn, rows) == 22
    assert _rows(engine, orders) == {f"k{i}": (f"s{i}", i) for i in range(45)}


def test_a_batch_row_without_version_writes_nothing(engine: Engine, orders: Table) -> None:
    guard = VersionGuard(orders, "id", "version")
    with engine.begin() as conn, pytest.raises(MissingVersion):
        guard.upsert_latest_many(conn, [
            {"id": "x", "state": "x", "version": 1},
            {"id": "y", "state": "y", "version": None},
        ])
    assert _rows(engine, orders) == {}


def test_composite_keys(engine: Engine) -> None:
    with temp_table(
        engine, "vg_stock",
        Column("warehouse", String(16), nullable=False),
        Column("sku", String(16), nullable=False),
        Column("qty", Integer),
        Column("version", Integer),
        UniqueConstraint("warehouse", "sku"),
    ) as stock:
        guard = VersionGuard(stock, ["warehouse", "sku"], "version")
        with engine.begin() as conn:
            assert guard.apply(conn, ("w1", "s1"), None, 1, {"qty": 10})
            assert guard.apply(conn, ("w1", "s1"), 1, 2, {"qty": 8})
            assert guard.upsert_latest(conn, ("w2", "s1"), 4, {"qty": 1})
            written = guard.upsert_latest_many(conn, [
                {"warehouse": "w1", "sku": "s1", "qty": 99, "version": 1},
                {"warehouse": "w2", "sku": "s1", "qty": 5, "version": 5},
            ])
            assert written == 1
            row = guard.read(conn, ("w1", "s1"))
            assert row is not None
            assert row["qty"] == 8
            assert guard.stored_version(conn, ("w2", "s1")) == 5


def test_a_deadlock_between_two_writers_is_a_need_retry(engine: Engine, orders: Table) -> None:
    if engine.dialect.name == "sqlite":
        pytest.skip("SQLite runs one writer at a time: it cannot deadlock")
    guard = VersionGuard(orders, "id", "version")
    with engine.begin() as conn:
        guard.upsert_latest(conn, "a", 1, {"state": "a1"})
        guard.upsert_latest(conn, "b", 1, {"state": "b1"})
    both_hold_one = threading.Barrier(2)
    outcomes: list[str] = []

    def write(first: str, second: str) -> None:
        try:
            with engine.begin() as conn:
                guard.upsert_latest(conn, first, 2, {"state": "x"})
                both_hold_one.wait()  # each holds one row and now wants the other's
                guard.upsert_latest(conn, second, 2, {"state": "x"})
            outcomes.append("committed")
        except NeedRetry as exc:
            outcomes.append(exc.reason)

    writers = [threading.Thread(target=write, args=pair) for pair in (("a", "b"), ("b", "a"))]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert sorted(outcomes)[0] == "committed"
    assert "deadlock" in sorted(outcomes)[1]
    assert _rows(engine, orders) == {"a": ("x", 2), "b": ("x", 2)}


# -- configuration ------------------------------------------------------------------------


def test_the_key_must_be_unique_and_values_must_be_real_columns() -> None:
    table = Table(
        "vg_loose", MetaData(),
        Column("id", Integer, primary_key=True),
        Column("name", String(10)),
        Column("version", Integer),
    )
    with pytest.raises(ConfigurationError, match="primary key or a unique constraint"):
        VersionGuard(table, "name", "version")
    with pytest.raises(ConfigurationError, match="no column"):
        VersionGuard(table, "id", "revision")
    guard = VersionGuard(table, "id", "version")
    with pytest.raises(ConfigurationError, match="key or version"):
        guard._values({"version": 3})
    with pytest.raises(ConfigurationError, match="no columns"):
        guard._values({"nmae": "typo"})


# -- through the consumer -----------------------------------------------------------------


def test_a_message_without_version_is_dead_lettered_and_the_rest_applied(
    engine: Engine, orders: Table
) -> None:
    guard = VersionGuard(orders, "id", "version")
    broker = InMemoryBroker(seed=3)
    broker.publish("orders", json.dumps({"id": "o9", "version": 0, "state": "new"}))
    broker.publish("orders", json.dumps({"id": "o9", "state": "no version"}))
    broker.publish("orders", json.dumps({"id": "o9", "expected": 0, "version": 1, "state": "paid"}))

    def handle(message: Message) -> None:
        body = message.body
        with engine.begin() as conn:
            guard.apply(conn, body["id"], body.get("expected"), body.get("version"),
                        {"state": body["state"]})

    Consumer(broker, handle, topics=["orders"], group="g", decoder=json.loads,
             retry=RetryPolicy(max_attempts=5)).run_until_idle(timeout=30)
    [dead] = assert_dead_lettered(broker, 1)
    assert dead.error_type == "msgpatterns.ordering.errors.MissingVersion"
    assert json.loads(dead.message.raw_body)["state"] == "no version"
    assert broker.pending == 0
    assert _rows(engine, orders) == {"o9": ("paid", 1)}
