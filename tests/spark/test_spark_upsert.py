"""upsert_latest: the newest version per key wins, whatever the order, replays and
half-written batches included."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from spark_streams import EVENT_SCHEMA, FileStream, event, orders_table, read_table

from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency.policy import StorePolicy
from msgpatterns.spark import SqlSpec, UpsertResult, upsert_latest
from msgpatterns.spark.latest import LatestRows
from msgpatterns.spark.upsert import _KEYS, _ROWS, _WRITTEN, _Target, _WritePartition

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

pytestmark = pytest.mark.spark

ORDER_COLUMNS = ["order_id", "version", "status"]


def frame(spark: SparkSession, *events: dict[str, Any]) -> DataFrame:
    return spark.createDataFrame(list(events), EVENT_SCHEMA).select(*ORDER_COLUMNS)


def put(engine: sa.Engine, table: sa.Table, *rows: tuple[str, int, str]) -> None:
    with engine.begin() as conn:
        conn.execute(table.insert(), [dict(zip(ORDER_COLUMNS, r, strict=True)) for r in rows])


@pytest.mark.parametrize("db_url", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres),
                                    pytest.param("mysql", marks=pytest.mark.mysql)],
                         indirect=True)
def test_the_newest_version_per_key_is_kept_and_older_ones_never_overwrite(
    spark: SparkSession, db_url: str, engine: sa.Engine, orders: sa.Table,
) -> None:
    put(engine, orders, ("o1", 5, "stored-newer"), ("o2", 1, "stored-older"))
    df = frame(
        spark,
        event("o1", 3), event("o1", 4),                    # older than the table: ignored
        event("o2", 2), event("o2", 7), event("o2", 3),    # out of order in the batch
        event("o3", 1, "a"), event("o3", 1, "b"),          # a tie: the same row every run
        event("o4", 2),
    )
    first = upsert_latest(df, db_url, orders.name, key="order_id", version="version")
    assert first == UpsertResult(rows=8, keys=4, written=3)
    expected = {"o1": (5, "stored-newer"), "o2": (7, "s7"), "o3": (1, "b"), "o4": (2, "s2")}
    assert read_table(engine, orders) == expected

    again = upsert_latest(df, db_url, orders.name, key="order_id", version="version",
                          batch_size=2)
    assert (again.keys, again.written, again.stale) == (4, 0, 4)
    assert read_table(engine, orders) == expected


def test_a_stream_with_out_of_order_versions_and_a_replayed_batch(
    stream: FileStream, db_url: str, engine: sa.Engine, orders: sa.Table,
) -> None:
    results: dict[int, UpsertResult] = {}

    def write(df: DataFrame, batch_id: int) -> None:
        results[batch_id] = upsert_latest(df.select(*ORDER_COLUMNS), db_url, orders.name,
                                          key="order_id", version="version")

    stream.add(event("o1", 2), event("o1", 1), event("o2", 1))     # out of order within
    stream.add(event("o1", 1), event("o2", 3), event("o3", 1))     # o1 v1 again: stale
    stream.add(event("o2", 2), event("o3", 2), event("o4", 1))     # o2 v2 after v3: stale
    stream.run(write)
    expected = {"o1": (2, "s2"), "o2": (3, "s3"), "o3": (2, "s2"), "o4": (1, "s1")}
    assert read_table(engine, orders) == expected
    assert [results[b].written for b in range(3)] == [2, 2, 2]

    stream.drop_last_commit()
    del results[2]
    stream.run(write)  # batch 2 again, no ledger: the version guard alone makes it harmless
    assert results[2] == UpsertResult(rows=3, keys=3, written=0)
    assert read_table(engine, orders) == expected

    stream.reset()  # a new checkpoint on the same table: its data is written
    stream.add(event("o1", 9), event("o4", 0))
    stream.run(write)
    assert read_table(engine, orders) == {**expected, "o1": (9, "s9")}


FAULTS = {
    "sqlite": [
        "CREATE TABLE {fault} (armed INTEGER)",
        "INSERT INTO {fault} VALUES (1)",
        "CREATE TRIGGER {fault}_trigger BEFORE INSERT ON {table} "
        "WHEN (SELECT count(*) FROM {table}) >= {after} AND EXISTS (SELECT 1 FROM {fault}) "
        "BEGIN SELECT RAISE(ABORT, 'injected failure'); END",
    ],
    "postgresql": [
        "CREATE TABLE {fault} (armed INTEGER)",
        "INSERT INTO {fault} VALUES (1)",
        "CREATE FUNCTION {fault}_fn() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "IF (SELECT count(*) FROM {table}) >= {after} AND EXISTS (SELECT 1 FROM {fault}) "
        "THEN RAISE EXCEPTION 'injected failure'; END IF; RETURN NEW; END $$",
        "CREATE TRIGGER {fault}_trigger BEFORE INSERT ON {table} "
        "FOR EACH ROW EXECUTE FUNCTION {fault}_fn()",
    ],
}


def test_a_partition_that_fails_half_way_is_completed_when_the_batch_is_retried(
    stream: FileStream, db_url: str, engine: sa.Engine, orders: sa.Table, unique: str,
) -> None:
    fault = f"spark_fault_{unique}"
    with engine.begin() as conn:
        for statement in FAULTS[engine.dialect.name]:
            conn.exec_driver_sql(statement.format(fault=fault, table=orders.name, after=30))
    # batch 0 sets 20 orders to version 5; batch 1 brings 80 new orders and, for the
    # first 20, versions both older and newer than what the table holds
    stream.add(*[event(f"o{n:03d}", 5) for n in range(20)])
    stream.add(*[event(f"o{n:03d}", 1) for n in range(100)],
               *[event(f"o{n:03d}", 7) for n in range(0, 20, 2)])

    def write(df: DataFrame, batch_id: int) -> None:
        upsert_latest(df.select(*ORDER_COLUMNS), db_url, orders.name, key="order_id",
                      version="version", batch_size=5)

    with pytest.raises(Exception, match="injected failure"):
        stream.run(write)
    half = read_table(engine, orders)
    assert 30 <= len(half) < 100, "the failure should hit after some chunks were written"

    with engine.begin() as conn:
        conn.exec_driver_sql(f"DELETE FROM {fault}")
    stream.run(write)  # Spark re-runs batch 1, including the rows already written
    expected = {f"o{n:03d}": (1, "s1") for n in range(20, 100)}
    expected.update({f"o{n:03d}": (7 if n % 2 == 0 else 5, "s7" if n % 2 == 0 else "s5")
                     for n in range(20)})
    assert read_table(engine, orders) == expected
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql(f"DROP TRIGGER {fault}_trigger ON {orders.name}")
            conn.exec_driver_sql(f"DROP FUNCTION {fault}_fn()")
        conn.exec_driver_sql(f"DROP TABLE {fault}")


SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


@SQLITE_ONLY
def test_mistakes_are_reported_on_the_driver_before_any_write(
    spark: SparkSession, db_url: str, engine: sa.Engine, orders: sa.Table, unique: str,
) -> None:
    loose = sa.Table(f"loose_{unique}", sa.MetaData(), *[
        sa.Column(c.name, c.type) for c in orders.columns])  # no primary key
    loose.create(engine)
    df = frame(spark, event("o1", 1))

    with pytest.raises(ConfigurationError, match="does not exist"):
        upsert_latest(df, db_url, "missing", key="order_id", version="version")
    with pytest.raises(ConfigurationError, match="no column"):
        upsert_latest(df.withColumn("extra", df.version), db_url, orders.name,
                      key="order_id", version="version")
    with pytest.raises(ConfigurationError, match="no column"):
        upsert_latest(df, db_url, orders.name, key="order_id", version="revision")
    with pytest.raises(ConfigurationError, match="unique"):
        upsert_latest(df, db_url, loose.name, key="order_id", version="version")
    with pytest.raises(ConfigurationError, match="batch_size"):
        upsert_latest(df, db_url, orders.name, key="order_id", version="version",
                      batch_size=0)
    assert read_table(engine, orders) == {}


@SQLITE_ONLY
def test_a_row_without_a_version_fails_the_job_with_a_clear_error(
    spark: SparkSession, db_url: str, orders: sa.Table,
) -> None:
    df = frame(spark, event("o1", 2), {**event("o1", 3), "version": None})
    with pytest.raises(Exception, match=r"MissingVersion: 1 row\(s\) of key \('o1',\)"):
        upsert_latest(df, db_url, orders.name, key="order_id", version="version")


@pytest.mark.postgres
def test_a_connection_killed_between_chunks_is_replaced_and_the_chunk_retried(
    postgres_url: str, unique: str,
) -> None:
    import pyarrow as pa

    engine = sa.create_engine(postgres_url)
    orders = orders_table(f"spark_orders_{unique}")
    orders.create(engine)
    app = f"mp-test-{unique}"
    spec = SqlSpec.of(postgres_url, {"connect_args": {"application_name": app}})
    target = _Target(spec, orders.name, None, ("order_id",), "version",
                     StorePolicy(attempts=3, wait=0.01))
    killed: list[int] = []

    def rows() -> Iterator[pa.RecordBatch]:
        for n in range(25):
            if n == 10:  # the writer is between its first and second chunk
                with engine.begin() as conn:
                    killed.append(conn.execute(sa.text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = :app"), {"app": app}).scalar_one())
            yield pa.RecordBatch.from_pylist([{"order_id": f"o{n}", "version": 1,
                                               "status": "s1"}])

    latest = LatestRows(("order_id",), "version", "sorted")
    (counts,) = _WritePartition(target, 10, latest)(rows())
    assert killed == [1]
    assert counts.to_pylist() == [{_ROWS: 25, _KEYS: 25, _WRITTEN: 25}]
    assert len(read_table(engine, orders)) == 25
    orders.drop(engine)
    engine.dispose()
