"""idempotent_batch: a replayed micro-batch is skipped; a reset checkpoint is not.

The replay is Spark's own: the last ``commits/N`` file of the checkpoint is deleted, as
if the driver died after the sink's write and before Spark's commit, and the query is
restarted on the same checkpoint. Spark then runs batch N again with the same id.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa
from spark_streams import FileStream, event

from msgpatterns.errors import ConfigurationError
from msgpatterns.spark import BatchLedger, SqlSpec, idempotent_batch, streaming_query_id

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row, SparkSession

pytestmark = pytest.mark.spark


def events_table(name: str) -> sa.Table:
    """An append-only sink: no key, so a batch written twice shows up twice."""
    return sa.Table(
        name, sa.MetaData(),
        sa.Column("event_id", sa.String(64), nullable=False),
        sa.Column("order_id", sa.String(64), nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
    )


@pytest.fixture
def events(engine: sa.Engine, unique: str) -> Iterator[sa.Table]:
    table = events_table(f"spark_events_{unique}")
    table.create(engine)
    yield table
    table.drop(engine)


@pytest.fixture
def ledger(db_url: str, unique: str) -> Iterator[BatchLedger]:
    ledger = BatchLedger(db_url, table=f"spark_ledger_{unique}")
    yield ledger
    ledger.drop_table()


class AppendFromExecutors:
    """``foreachPartition``: plain INSERTs of the partition's rows (no dedup at all)."""

    def __init__(self, url: str, table: str) -> None:
        self.spec = SqlSpec.of(url)
        self.table = table

    def __call__(self, rows: Iterator[Row]) -> None:
        records = [r.asDict() for r in rows]
        if records:
            table = self.spec.table(self.table)
            with self.spec.engine().begin() as conn:
                conn.execute(table.insert(), records)


def append_sink(url: str, table: sa.Table) -> Any:
    def write(df: DataFrame, batch_id: int) -> None:
        df.select("event_id", "order_id", "version").foreachPartition(
            AppendFromExecutors(url, table.name)
        )
    return write


def appended(engine: sa.Engine, table: sa.Table) -> list[tuple[str, int]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(table.c.event_id, table.c.version))
        return sorted((r.event_id, r.version) for r in rows)


def three_batches(stream: FileStream) -> list[tuple[str, int]]:
    stream.add(event("o1", 1), event("o2", 1))
    stream.add(event("o1", 2), event("o3", 1))
    stream.add(event("o2", 2), event("o3", 2), event("o4", 1))
    return sorted((f"{o}:v{v}", v) for o, v in
                  [("o1", 1), ("o2", 1), ("o1", 2), ("o3", 1), ("o2", 2), ("o3", 2), ("o4", 1)])


def test_a_replayed_batch_is_skipped_and_a_reset_checkpoint_writes(
    stream: FileStream, db_url: str, engine: sa.Engine, events: sa.Table, ledger: BatchLedger,
) -> None:
    expected = three_batches(stream)
    sink = idempotent_batch(append_sink(db_url, events), ledger, "events-sink")
    query_id = stream.run(sink)
    assert appended(engine, events) == expected
    assert (sink.stats.written, sink.stats.skipped) == (3, 0)

    assert stream.drop_last_commit() == 2
    assert stream.run(sink) == query_id  # the checkpoint keeps the query id
    assert appended(engine, events) == expected, "the replayed batch was written twice"
    assert (sink.stats.written, sink.stats.skipped) == (3, 1)

    stream.add(event("o5", 1))  # nothing is lost after the replay
    stream.run(sink)
    assert appended(engine, events) == sorted([*expected, ("o5:v1", 1)])

    # A reset checkpoint is a new query: its batches 0..3 are new, never skipped (an
    # append sink then holds everything twice - the data is not silently dropped).
    stream.new_checkpoint()
    assert stream.run(sink) != query_id
    assert appended(engine, events) == sorted(2 * [*expected, ("o5:v1", 1)])
    assert (sink.stats.written, sink.stats.skipped) == (8, 1)


def test_transactional_mode_commits_the_ledger_row_with_the_write(
    stream: FileStream, engine: sa.Engine, events: sa.Table, ledger: BatchLedger,
) -> None:
    expected = three_batches(stream)
    attempts: list[int] = []

    def write(df: DataFrame, batch_id: int, conn: sa.Connection) -> None:
        rows = [r.asDict() for r in df.select("event_id", "order_id", "version").collect()]
        conn.execute(events.insert(), rows)
        attempts.append(batch_id)
        if len(attempts) == 2:  # the sink fails after its INSERT, before the commit
            raise RuntimeError("connection lost before commit")

    sink = idempotent_batch(write, ledger, "events-tx", transactional=True)
    with pytest.raises(Exception, match="connection lost before commit"):
        stream.run(sink)
    # batch 0 committed; batch 1 rolled back with its ledger row
    assert appended(engine, events) == [("o1:v1", 1), ("o2:v1", 1)]

    query_id = stream.run(sink)  # the restart re-runs batch 1, then batch 2
    assert appended(engine, events) == expected
    assert ledger.last_batch("events-tx", query_id) == 2

    stream.drop_last_commit()
    stream.run(sink)
    assert appended(engine, events) == expected
    assert attempts == [0, 1, 1, 2]
    assert sink.stats.skipped == 1


def test_outside_a_streaming_query_there_is_no_query_id(spark: SparkSession) -> None:
    with pytest.raises(ConfigurationError, match="foreachBatch"):
        streaming_query_id(spark.range(1))
