"""append_rows: a partition written by two task attempts, two concurrent copies or a
replayed batch is in the table once.

The re-attempt is Spark's own: the session allows two attempts per task, and a
partition writer fails its first attempt *after* its transaction committed (as when
an executor is lost after the write), so Spark runs the task again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from spark_streams import EVENT_SCHEMA, AppendRows, FileStream, appended, event

from msgpatterns.errors import ConfigurationError
from msgpatterns.spark import AppendResult, append_rows
from msgpatterns.spark.append import _Append, partition_ledger_table
from msgpatterns.spark.resources import SqlSpec

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, Row, SparkSession

pytestmark = pytest.mark.spark

COLUMNS = ["event_id", "order_id", "version"]


def events_frame(spark: SparkSession, count: int, partitions: int = 2) -> DataFrame:
    rows = [event(f"o{n}", 1) for n in range(count)]
    return spark.createDataFrame(rows, EVENT_SCHEMA).select(*COLUMNS).repartition(
        partitions, "event_id")


def expected(count: int) -> list[tuple[str, int]]:
    return sorted((f"o{n}:v1", 1) for n in range(count))


def _attempt() -> int:
    from pyspark import TaskContext

    context = TaskContext.get()
    return context.attemptNumber() if context is not None else 0


class FailFirstAttemptAfterWrite:
    """``mapInArrow``: the real partition write, then the first attempt of the task
    fails - the transaction committed, Spark runs the task again."""

    def __init__(self, write: _Append) -> None:
        self.write = write

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        yield from self.write(batches)
        if _attempt() == 0:
            raise RuntimeError("executor lost after the partition committed")


class AppendThenFailFirstAttempt:
    """The documented plain pattern (``foreachPartition(AppendRows)``) under the
    same fault."""

    def __init__(self, url: str, table: str) -> None:
        self.append = AppendRows(url, table)

    def __call__(self, rows: Iterator[Row]) -> None:
        self.append(rows)
        if _attempt() == 0:
            raise RuntimeError("executor lost after the partition committed")


def test_a_reattempted_task_writes_its_partition_once(
    spark: SparkSession, db_url: str, engine: sa.Engine, events: sa.Table, unique: str,
) -> None:
    df = events_frame(spark, 40)
    write = _Append(SqlSpec.of(db_url), events.name, None, f"parts_{unique}", "events", "q1", 7,
                    "call-1")
    append_rows(df.limit(0), db_url, events.name, sink_id="events", batch_id=0,
                query_id="q1", ledger_table=f"parts_{unique}")  # creates the ledger table
    states = df.mapInArrow(FailFirstAttemptAfterWrite(write),
                           "p int, n long, s tinyint").collect()
    # both partitions: the re-attempt wrote nothing, and counts what its first attempt
    # (the same call) committed, so the call's result is exact
    assert sorted(s[2] for s in states) == [1, 1]
    assert sum(s[1] for s in states) == 40
    assert appended(engine, events) == expected(40)
    _drop(engine, f"parts_{unique}")


def test_a_ledger_table_from_before_call_ids_gets_the_column(
    spark: SparkSession, db_url: str, engine: sa.Engine, events: sa.Table, unique: str,
) -> None:
    partition_ledger_table(f"parts_{unique}").create(engine)
    with engine.begin() as conn:  # the table as it was made before call ids
        conn.execute(sa.text(f"ALTER TABLE parts_{unique} DROP COLUMN call_id"))
    df = events_frame(spark, 10)
    options: dict[str, Any] = {"sink_id": "events", "batch_id": 1, "query_id": "q1",
                               "ledger_table": f"parts_{unique}"}
    assert append_rows(df, db_url, events.name, **options) == AppendResult(10, 2, 0)
    assert append_rows(df, db_url, events.name, **options) == AppendResult(0, 0, 2)
    _drop(engine, f"parts_{unique}")


SQLITE_ONLY = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)


@SQLITE_ONLY
def test_the_plain_foreach_partition_append_writes_a_reattempted_partition_twice(
    spark: SparkSession, db_url: str, engine: sa.Engine, events: sa.Table,
) -> None:
    """Why append_rows exists: the same fault doubles a plain append (on any database:
    SQLite only)."""
    events_frame(spark, 40).foreachPartition(AppendThenFailFirstAttempt(db_url, events.name))
    rows = appended(engine, events)
    assert len(rows) == 80 and sorted(set(rows)) == expected(40)


def test_a_replayed_or_concurrent_batch_appends_nothing_twice(
    spark: SparkSession, db_url: str, engine: sa.Engine, events: sa.Table, unique: str,
) -> None:
    df = events_frame(spark, 30, partitions=3)
    options: dict[str, Any] = {"sink_id": "events", "batch_id": 4, "query_id": "q1",
                               "ledger_table": f"parts_{unique}"}
    first = append_rows(df, db_url, events.name, **options)
    assert first == AppendResult(rows=30, partitions=3, skipped=0)
    assert append_rows(df, db_url, events.name, **options) == AppendResult(0, 0, 3)

    # two copies of batch 5 at once (speculative tasks): one of each partition commits
    results: list[AppendResult] = []
    batch = {**options, "batch_id": 5}
    copies = [threading.Thread(target=lambda: results.append(
        append_rows(df, db_url, events.name, **batch))) for _ in range(2)]
    for copy in copies:
        copy.start()
    for copy in copies:
        copy.join(240)
    assert sum(r.partitions for r in results) == 3
    assert sum(r.skipped for r in results) == 3
    assert appended(engine, events) == sorted(expected(30) * 2)

    # the same batch id under another query (a new checkpoint) is written
    again = append_rows(df, db_url, events.name, **{**options, "query_id": "q2"})
    assert again.rows == 30
    _drop(engine, f"parts_{unique}")


@SQLITE_ONLY  # the ledger's statements on PostgreSQL: the replayed and concurrent test
def test_a_stream_replayed_after_a_driver_crash_appends_once(
    stream: FileStream, db_url: str, engine: sa.Engine, events: sa.Table, unique: str,
) -> None:
    results: dict[int, AppendResult] = {}

    def write(df: DataFrame, batch_id: int) -> None:
        results[batch_id] = append_rows(df.select(*COLUMNS), db_url, events.name,
                                        sink_id="events", batch_id=batch_id,
                                        ledger_table=f"parts_{unique}")

    stream.add(event("o1", 1), event("o2", 1))
    stream.add(event("o1", 2), event("o3", 1), event("o4", 1))
    stream.run(write)
    assert stream.drop_last_commit() == 1
    stream.run(write)  # no idempotent_batch: the partition ledger alone skips batch 1
    assert results[1].rows == 0 and results[1].skipped >= 1
    assert appended(engine, events) == sorted(
        [("o1:v1", 1), ("o2:v1", 1), ("o1:v2", 2), ("o3:v1", 1), ("o4:v1", 1)])
    _drop(engine, f"parts_{unique}")


def test_mistakes_fail_on_the_driver(spark: SparkSession, sqlite_url: str) -> None:
    df = spark.createDataFrame([event("o1", 1)], EVENT_SCHEMA)
    with pytest.raises(ConfigurationError, match="does not exist"):
        append_rows(df, sqlite_url, "missing", sink_id="s", batch_id=0, query_id="q")
    with pytest.raises(ConfigurationError, match="batch_id"):
        append_rows(df, sqlite_url, "missing", sink_id="s", batch_id=-1, query_id="q")
    with pytest.raises(ConfigurationError, match="foreachBatch"):
        append_rows(df, sqlite_url, "missing", sink_id="s", batch_id=0)


def _drop(engine: sa.Engine, name: str) -> None:
    sa.Table(name, sa.MetaData()).drop(engine, checkfirst=True)
