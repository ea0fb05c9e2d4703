"""VersionGuard on SQLite, PostgreSQL and MariaDB: strict transitions and latest-wins.

Every test taking ``db`` runs twice: on the sync API (``VersionGuard`` on an Engine)
and on the async one (``AsyncVersionGuard`` on an AsyncEngine: psycopg 3 async,
aiosqlite, aiomysql), one body behind :class:`ordering_db.SqlSide`. Sync only: the
deadlock between two writer threads (the async peer is in
tests/aio/test_async_version_guard.py) and the run through the sync Consumer."""

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
from msgpatterns.aio import AsyncVersionGuard
from msgpatterns.errors import ConfigurationError, MalformedMessage
from msgpatterns.ordering import InvalidVersion, MissingVersion, VersionConflict, VersionGuard
from msgpatterns.testing import assert_dead_lettered
from ordering_db import MODES, SqlSide, engine_for, orders_table, sql_side, temp_table


@pytest.fixture
def engine(sql_url: str) -> Iterator[Engine]:
    with engine_for(sql_url) as engine:
        yield engine


@pytest.fixture(params=MODES)
def db(request: pytest.FixtureRequest, engine: Engine) -> Iterator[SqlSide]:
    with sql_side(request.param, engine) as side:
        yield side


@pytest.fixture
def orders(engine: Engine) -> Iterator[Table]:
    with orders_table(engine, "vg_orders") as table:
        yield table


def _rows(engine: Engine, table: Table) -> dict[Any, tuple[Any, ...]]:
    with engine.connect() as conn:
        return {row[0]: tuple(row[1:]) for row in conn.execute(select(table))}


# -- apply ------------------------------------------------------------------------------


def test_apply_creates_then_follows_the_chain_and_skips_duplicates(
    db: SqlSide, engine: Engine, orders: Table
) -> None:
    guard = db.guard(orders, "id", "version")
    with db.begin() as conn:
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
    db: SqlSide, engine: Engine, orders: Table
) -> None:
    guard = db.guard(orders, "id", "version")
    with db.begin() as conn:
        with pytest.raises(NeedRetry, match="waiting for 0"):
            guard.apply(conn, "o2", 0, 1, {"state": "paid"})  # the row does not exist yet
        guard.apply(conn, "o2", None, 0, {"state": "new"})
        with pytest.raises(NeedRetry, match="at version 0, waiting for 1"):
            guard.apply(conn, "o2", 1, 2, {"state": "refunding"})
        assert guard.apply(conn, "o2", 0, 1, {"state": "paid"})
        assert guard.apply(conn, "o2", 1, 2, {"state": "refunding"})
    assert _rows(engine, orders) == {"o2": ("refunding", 2)}


def test_apply_rejects_a_transition_that_can_never_apply(
    db: SqlSide, engine: Engine, orders: Table
) -> None:
    guard = db.guard(orders, "id", "version")
    with db.begin() as conn:
        guard.apply(conn, "o3", None, 3, {"state": "x"})
        with pytest.raises(VersionConflict, match="can never apply"):
            guard.apply(conn, "o3", 1, 4, {"state": "y"})  # 3 lies between 1 and 4
        with pytest.raises(VersionConflict):
            guard.apply(conn, "o3", None, 4, {"state": "y"})  # exists, but "create" came
    assert _rows(engine, orders) == {"o3": ("x", 3)}


def test_bad_versions_are_typed_malformed_messages(
    db: SqlSide, engine: Engine, orders: Table
) -> None:
    guard = db.guard(orders, "id", "version")
    with db.begin() as conn:
        with pytest.raises(MissingVersion):
            guard.apply(conn, "o4", 0, None)
        with pytest.raises(InvalidVersion, match="not after"):
            guard.apply(conn, "o4", 2, 2)
        with pytest.raises(InvalidVersion, match="cannot compare"):
            guard.apply(conn, "o4", "1", 2)
        with pytest.raises(MissingVersion):
            guard.upsert_latest(conn, "o4", None, {"state": "x"})
        with pytest.raises(MalformedMessage):
            guard.apply(conn, "", None, 0)
        with pytest.raises(ConfigurationError, match="key or version"):
            guard.apply(conn, "o4", None, 0, {"version": 7})
    assert _rows(engine, orders) == {}


def test_compare_and_set_read_and_stored_version(db: SqlSide, orders: Table) -> None:
    guard = db.guard(orders, "id", "version")
    with db.begin() as conn:
        assert guard.read(conn, "o5") is None
        assert guard.stored_version(conn, "o5") is None
        assert guard.compare_and_set(conn, "o5", None, 1, {"state": "a"}) is True
        assert guard.compare_and_set(conn, "o5", None, 1, {"state": "b"}) is False
        assert guard.compare_and_set(conn, "o5", 0, 2, {"state": "c"}) is False
        assert guard.compare_and_set(conn, "o5", 1, 2, {"state": "d"}) is True
        row = guard.read(conn, "o5")
        assert (row["id"], row["state"], row["version"]) == ("o5", "d", 2)
        assert guard.stored_version(conn, "o5") == 2


# -- transactions -------------------------------------------------------------------------


def test_an_engine_given_as_conn_commits_each_call_on_its_own(
    db: SqlSide, engine: Engine, orders: Table
) -> None:
    guard = db.guard(orders, "id", "version")
    assert guard.upsert_latest(db.bind, "e", 1, {"state": "one"}) is True
    assert guard.apply(db.bind, "e", 1, 2, {"state": "two"}) is True
    assert _rows(engine, orders) == {"e": ("two", 2)}
    assert guard.stored_version(db.bind, "e") == 2


def test_the_write_rolls_back_with_the_callers_transaction(
    db: SqlSide, engine: Engine, orders: Table
) -> None:
    guard = db.guard(orders, "id", "version")
    seen: list[Any] = []

    def handle() -> None:
        with db.begin() as conn:
            assert guard.apply(conn, "t", None, 0, {"state": "created"})
            seen.append(guard.stored_version(conn, "t"))  # visible in the transaction
            raise RuntimeError("handler failed after the write")

    with pytest.raises(RuntimeError, match="handler failed"):
        handle()
    assert seen == [0]
    assert _rows(engine, orders) == {}


def test_calls_on_one_connection_commit_together(
    db: SqlSide, engine: Engine, orders: Table
) -> None:
    guard = db.guard(orders, "id", "version")
    with db.connect() as conn:
        assert guard.apply(conn, "m", None, 0, {"state": "a"})
        assert guard.apply(conn, "m", 0, 1, {"state": "b"})
        assert _rows(engine, orders) == {}  # not committed yet
        db.commit(conn)
    assert _rows(engine, orders) == {"m": ("b", 1)}


def test_a_null_stored_version_counts_as_no_version_yet(
    db: SqlSide, engine: Engine, orders: Table
) -> None:
    guard = db.guard(orders, "id", "version")
    with engine.begin() as conn:
        conn.execute(orders.insert().values(id="n1", state="legacy", version=None))
        conn.execute(orders.insert().values(id="n2", state="legacy", version=None))
    with db.begin() as conn:
        assert guard.apply(conn, "n1", None, 0, {"state": "versioned"})
        assert guard.upsert_latest(conn, "n2", 1, {"state": "versioned"})
    assert _rows(engine, orders) == {"n1": ("versioned", 0), "n2": ("versioned", 1)}


def test_keys_and_values_are_data_not_sql(db: SqlSide, engine: Engine, orders: Table) -> None:
    guard = db.guard(orders, "id", "version")
    nasty = "x'); DROP TABLE users; --"
    with db.begin() as conn:
        assert guard.apply(conn, nasty, None, 1, {"state": "' OR 1=1 --"})
        assert guard.upsert_latest(conn, nasty + '"', 1, {"state": "`;"})
    assert _rows(engine, orders) == {nasty: ("' OR 1=1 --", 1), nasty + '"': ("`;", 1)}


# -- upsert_latest ------------------------------------------------------------------------


def test_upsert_latest_never_overwrites_a_newer_row(
    db: SqlSide, engine: Engine, orders: Table
) -> None:
    guard = db.guard(orders, "id", "version")
    with db.begin() as conn:
        results = [
            guard.upsert_latest(conn, "p", version, {"state": f"v{version}"})
            for version in (5, 3, 5, 7, 6, 7, 8)
        ]
    assert results == [True, False, False, True, False, False, True]
    assert _rows(engine, orders) == {"p": ("v8", 8)}


def test_upsert_latest_orders_by_timestamp_too(db: SqlSide, engine: Engine) -> None:
    with temp_table(
        engine, "vg_prices",
        Column("sku", String(32), primary_key=True),
        Column("price", Integer),
        Column("updated_at", DateTime),
    ) as prices:
        guard = db.guard(prices, prices.c.sku, prices.c.updated_at)
        t0 = datetime(2024, 1, 1, 12, 0, 0)
        with db.begin() as conn:
            assert guard.upsert_latest(conn, "sku-1", t0 + timedelta(seconds=2), {"price": 2})
            assert not guard.upsert_latest(conn, "sku-1", t0, {"price": 0})
            assert guard.upsert_latest(conn, "sku-1", t0 + timedelta(seconds=3), {"price": 3})
        assert _rows(engine, prices) == {"sku-1": (3, t0 + timedelta(seconds=3))}


# -- upsert_latest_many -------------------------------------------------------------------


def test_batch_writes_only_newer_rows_and_counts_them(
    db: SqlSide, engine: Engine, orders: Table
) -> None:
    guard = db.guard(orders, "id", "version")
    with db.begin() as conn:
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
    with db.begin() as conn:
        assert guard.upsert_latest_many(conn, batch) == 2
    # On MySQL/MariaDB a wrong assignment order (version first) would leave "a2" here.
    assert _rows(engine, orders) == {"a": ("a5", 5), "b": ("b9", 9), "c": ("c3", 3)}
    with db.begin() as conn:
        assert guard.upsert_latest_many(conn, batch) == 0
        assert guard.upsert_latest_many(conn, []) == 0


def test_batch_splits_large_inputs_into_several_statements(
    db: SqlSide, engine: Engine, orders: Table, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(version_guard_module, "MAX_PARAMETERS", 30)  # 10 rows per statement
    guard = db.guard(orders, "id", "version")
    rows = [{"id": f"k{i}", "state": f"s{i}", "version": i} for i in range(45)]
    with db.begin() as conn:
        assert guard.upsert_latest_many(conn, rows[::2]) == 23
        assert guard.upsert_latest_many(conn, rows) == 22
    assert _rows(engine, orders) == {f"k{i}": (f"s{i}", i) for i in range(45)}


def test_a_large_batch_writes_every_row(db: SqlSide, engine: Engine, orders: Table) -> None:
    """From COPY_MIN_ROWS rows PostgreSQL's sync path goes by COPY, the async one by
    executemany: both write the same."""
    guard = db.guard(orders, "id", "version")
    batch = [{"id": f"r{i:03}", "state": str(i), "version": i} for i in range(150)]
    with db.begin() as conn:
        assert guard.upsert_latest_many(conn, batch) == 150
    newer = [{**row, "version": row["version"] + 1, "state": "new"} for row in batch[::2]]
    with db.begin() as conn:
        assert guard.upsert_latest_many(conn, newer + batch[1::2]) == 75
    stored = _rows(engine, orders)
    assert len(stored) == 150
    assert sum(1 for state, _ in stored.values() if state == "new") == 75


def test_a_batch_row_without_version_writes_nothing(
    db: SqlSide, engine: Engine, orders: Table
) -> None:
    guard = db.guard(orders, "id", "version")
    with db.begin() as conn, pytest.raises(MissingVersion):
        guard.upsert_latest_many(conn, [
            {"id": "x", "state": "x", "version": 1},
            {"id": "y", "state": "y", "version": None},
        ])
    assert _rows(engine, orders) == {}


def test_composite_keys(db: SqlSide, engine: Engine) -> None:
    with temp_table(
        engine, "vg_stock",
        Column("warehouse", String(16), nullable=False),
        Column("sku", String(16), nullable=False),
        Column("qty", Integer),
        Column("version", Integer),
        UniqueConstraint("warehouse", "sku"),
    ) as stock:
        guard = db.guard(stock, ["warehouse", "sku"], "version")
        with db.begin() as conn:
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


@pytest.mark.parametrize("make", [VersionGuard, AsyncVersionGuard], ids=MODES)
def test_the_key_must_be_unique_and_values_must_be_real_columns(make: Any) -> None:
    table = Table(
        "vg_loose", MetaData(),
        Column("id", Integer, primary_key=True),
        Column("name", String(10)),
        Column("version", Integer),
    )
    with pytest.raises(ConfigurationError, match="primary key or a unique constraint"):
        make(table, "name", "version")
    with pytest.raises(ConfigurationError, match="no column"):
        make(table, "id", "revision")
    with pytest.raises(ConfigurationError, match="Table"):
        make("vg_loose", "id", "version")
    guard = VersionGuard(table, "id", "version")  # the values' checks: shared by both
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
