"""idempotent_batch: a replayed micro-batch is skipped; a reset checkpoint is not.

The replay is Spark's own: the last ``commits/N`` file of the checkpoint is deleted, as
if the driver died after the sink's write and before Spark's commit, and the query is
restarted on the same checkpoint. Spark then runs batch N again with the same id.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa
from spark_streams import FileStream, append_sink, appended, event

from msgpatterns.errors import ConfigurationError
from msgpatterns.spark import BatchLedger, IdempotentBatch, idempotent_batch, streaming_query_id

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

pytestmark = pytest.mark.spark


@pytest.fixture
def ledger(db_url: str, unique: str) -> Iterator[BatchLedger]:
    ledger = BatchLedger(db_url, table=f"spark_ledger_{unique}")
    yield ledger
    ledger.drop_table()


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

    # A reset - new checkpoint, new source - starts again at batch 0 under a new query
    # id. Batch 0 of the old query is in the ledger; a ledger keyed on (sink, batch)
    # alone would skip the new batch 0 and silently drop its data.
    assert ledger.is_recorded("events-sink", query_id, 0)
    stream.reset()
    stream.add(event("o9", 1), event("o9", 2))
    assert stream.run(sink) != query_id
    assert appended(engine, events) == sorted([*expected, ("o5:v1", 1), ("o9:v1", 1),
                                               ("o9:v2", 2)])
    assert (sink.stats.written, sink.stats.skipped) == (5, 1)


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


def test_a_sink_scoped_ledger_does_not_rewrite_processed_input_under_a_new_checkpoint(
    stream: FileStream, db_url: str, engine: sa.Engine, events: sa.Table, unique: str,
) -> None:
    """Issue 20, 4 (Delta's txnAppId): the ledger and the partition ledger keyed on the
    sink alone; a new checkpoint over the same input writes nothing again. The default
    (keyed on the query) writes it again - the other side of the trade-off."""
    from msgpatterns.spark import append_rows

    expected = three_batches(stream)
    ledgers = {scope: BatchLedger(db_url, table=f"spark_ledger_{scope}_{unique}", scope=scope)
               for scope in ("sink", "query")}

    def sink(scope: str) -> IdempotentBatch:
        def write(df: DataFrame, batch_id: int) -> None:
            append_rows(df.select("event_id", "order_id", "version"), db_url, events.name,
                        sink_id="events", batch_id=batch_id,
                        query_id="" if scope == "sink" else None,
                        ledger_table=f"spark_parts_{scope}_{unique}")
        return idempotent_batch(write, ledgers[scope], "events")

    by_sink = sink("sink")
    stream.run(by_sink)
    assert appended(engine, events) == expected
    stream.new_checkpoint()  # same files, new query id
    stream.run(by_sink)
    assert appended(engine, events) == expected, "a new checkpoint appended processed input"
    assert (by_sink.stats.written, by_sink.stats.skipped) == (3, 3)

    stream.new_checkpoint()
    stream.run(sink("query"))  # keyed on the query: the new checkpoint writes its batches
    assert appended(engine, events) == sorted(expected * 2)
    for scope, ledger in ledgers.items():
        ledger.drop_table()
        sa.Table(f"spark_parts_{scope}_{unique}", sa.MetaData()).drop(engine, checkfirst=True)
