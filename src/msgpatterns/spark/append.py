"""append_rows: append a micro-batch to a SQL table exactly once per partition.

Spark runs a partition's task more than once: a task re-attempt after a failure, a
speculative copy, a result stage re-run after an executor was lost, the whole batch
again after a driver crash. A plain ``foreachPartition`` insert then commits the same
rows twice. Here every partition is written in ONE transaction that first inserts the
partition's ledger row ``(sink_id, query_id, batch_id, partition)`` in the same
database: a second attempt finds the row (or waits on its key while the first attempt
is still open) and writes nothing. Rows and ledger row commit together or not at all.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from msgpatterns._extras import require
from msgpatterns.errors import ConfigurationError
from msgpatterns.spark.batch import streaming_query_id
from msgpatterns.spark.ledger import SINK_ID_MAX, check_sink_id
from msgpatterns.spark.resources import SqlSpec

require("sqlalchemy", "spark")

import sqlalchemy as sa  # noqa: E402

from msgpatterns import _sql  # noqa: E402

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame
    from sqlalchemy import URL

__all__ = ["AppendResult", "append_rows", "partition_ledger_table"]

#: Batches kept per sink and query in the partition ledger (Spark only re-runs its
#: last batch); older rows are deleted as new batches are written.
RETAIN = 100

_PARTITION = "__msgpatterns_partition"
_ROWS = "__msgpatterns_rows"
_STATE = "__msgpatterns_state"
#: What one task did with its partition.
_EMPTY, _WRITTEN, _SKIPPED = 0, 1, 2


def partition_ledger_table(name: str, metadata: sa.MetaData | None = None) -> sa.Table:
    """The partition ledger's table (primary key: sink, query, batch, partition)."""
    return sa.Table(
        name, metadata if metadata is not None else sa.MetaData(),
        sa.Column("sink_id", sa.String(SINK_ID_MAX), primary_key=True),
        sa.Column("query_id", sa.String(64), primary_key=True),
        sa.Column("batch_id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("partition_id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("row_count", sa.BigInteger, nullable=False),
        sa.Column("recorded_at", sa.BigInteger, nullable=False),  # epoch milliseconds
        # the append_rows call that wrote the row: a re-attempt of the same call (its
        # first attempt committed, then its result was lost with the executor) counts
        # the partition as written by this call, not as skipped
        sa.Column("call_id", sa.String(32), nullable=True),
    )


def _add_call_id(engine: sa.Engine, ledger: sa.Table) -> None:
    """Give a ledger table made before ``call_id`` existed its column."""
    columns = {c["name"] for c in sa.inspect(engine).get_columns(ledger.name)}
    if "call_id" in columns:
        return
    try:
        with engine.begin() as conn:
            # constant DDL; SQLAlchemy quotes the table's name into %(fullname)s
            add = sa.DDL(  # type: ignore[no-untyped-call]
                "ALTER TABLE %(fullname)s ADD COLUMN call_id VARCHAR(32)")
            conn.execute(add.against(ledger))
    except sa.exc.DBAPIError:
        columns = {c["name"] for c in sa.inspect(engine).get_columns(ledger.name)}
        if "call_id" not in columns:
            raise  # not a race with another driver adding it


@dataclass(frozen=True)
class AppendResult:
    """What one :func:`append_rows` call did.

    Attributes:
        rows: rows inserted by this call (exact: a partition whose first task attempt
            committed and whose result was then lost with its executor counts once, with
            its rows, when the re-attempt finds its ledger row).
        partitions: non-empty partitions written by this call.
        skipped: non-empty partitions found in the ledger, written by an earlier call
            (a replayed batch); their rows were not inserted again.
    """

    rows: int
    partitions: int
    skipped: int


@dataclass(frozen=True)
class _Append:
    """``mapInArrow``: one partition, one transaction, one ledger row; yields
    (partition, rows inserted, what happened)."""

    sql: SqlSpec
    table: str
    schema: str | None
    ledger: str
    sink_id: str
    query_id: str
    batch_id: int
    call_id: str

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa
        from pyspark import TaskContext

        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        first = next(batches, None)
        while first is not None and first.num_rows == 0:
            first = next(batches, None)
        rows, state = 0, _EMPTY
        if first is not None:  # an empty partition writes nothing, not even its ledger row
            rows, state = self._write(partition, first, batches)
        yield pa.RecordBatch.from_pydict({
            _PARTITION: pa.array([partition], pa.int32()),
            _ROWS: pa.array([rows], pa.int64()),
            _STATE: pa.array([state], pa.int8()),
        })

    def _write(self, partition: int, first: pa.RecordBatch,
               rest: Iterator[pa.RecordBatch]) -> tuple[int, int]:
        target = self.sql.table(self.table, self.schema)
        ledger = partition_ledger_table(self.ledger)
        keys = [ledger.c.sink_id, ledger.c.query_id, ledger.c.batch_id, ledger.c.partition_id]
        row = {"sink_id": self.sink_id, "query_id": self.query_id, "batch_id": self.batch_id,
               "partition_id": partition, "row_count": 0,
               "recorded_at": int(time.time() * 1000), "call_id": self.call_id}
        rows = 0
        with self.sql.engine().begin() as conn:
            # the ledger row first: another attempt of this partition waits on its key,
            # then finds it and writes nothing
            if not _sql.insert_if_absent(conn, ledger, keys, row):
                found = conn.execute(sa.select(ledger.c.call_id, ledger.c.row_count)
                                     .where(*(c == row[c.key] for c in keys))).first()
                if found is not None and found.call_id == self.call_id:
                    return int(found.row_count), _WRITTEN  # this call's earlier attempt
                return 0, _SKIPPED
            insert = target.insert()
            batch: pa.RecordBatch | None = first
            while batch is not None:
                if batch.num_rows:
                    conn.execute(insert, batch.to_pylist())
                    rows += batch.num_rows
                batch = next(rest, None)
            conn.execute(sa.update(ledger).where(*(c == row[c.key] for c in keys))
                         .values(row_count=rows))
        return rows, _WRITTEN


def append_rows(
    df: DataFrame,
    url: str | URL,
    table: str,
    *,
    sink_id: str,
    batch_id: int,
    query_id: str | None = None,
    checkpoint: str | None = None,
    schema: str | None = None,
    ledger_table: str = "msgpatterns_partitions",
    engine_options: Mapping[str, Any] | None = None,
) -> AppendResult:
    """Insert ``df``'s rows into ``table``, each partition exactly once.

    Args:
        df: the batch (inside ``foreachBatch``); its columns must be columns of
            ``table``.
        url: SQLAlchemy URL of PostgreSQL, MySQL/MariaDB or SQLite (a file); the
            executors connect with it, and the ledger table lives there too.
        table: an existing table.
        sink_id: names this sink (stable across deployments; one per target).
        batch_id: the micro-batch id ``foreachBatch`` gave.
        query_id: the streaming query's id: by default the running query's (see
            :func:`~msgpatterns.spark.streaming_query_id`; on Spark Connect give
            ``checkpoint``). ``""`` keys the ledger on ``sink_id`` alone, so that a new
            checkpoint over processed input does not append it again (see the docs for
            the trade-off).
        checkpoint: the query's ``checkpointLocation``, where Spark Connect finds the
            query id.
        schema: the table's schema, if not the default one.
        ledger_table: the partition ledger table, created on first use.
        engine_options: keyword arguments for ``sqlalchemy.create_engine``.

    Guarantee: each partition's rows commit in one transaction with the partition's
    ledger row ``(sink_id, query_id, batch_id, partition)``. A task re-attempt, a
    speculative copy, a re-run stage or the whole batch replayed after a driver crash
    finds the row and inserts nothing. It needs **deterministic partitioning**: a
    re-run of partition ``p`` of batch ``batch_id`` must hold the same rows as the
    first run (true for file, Kafka and rate sources and for hash-partitioned
    shuffles; not for ``repartition(n)`` without columns, ``sample`` or
    ``limit``: use ``repartition(n, *columns)``). An empty partition writes no ledger
    row.

    Cost: one ledger insert and one update per non-empty partition, in the
    partition's transaction. Works on classic and Spark Connect sessions (a
    ``mapInArrow`` job; the counts come back with its result).
    """
    require("pyspark", "spark")
    if not isinstance(batch_id, int) or batch_id < 0:
        raise ConfigurationError("batch_id must be the micro-batch id (an int >= 0)")
    if query_id is None:
        query_id = streaming_query_id(df, checkpoint)
    if not isinstance(query_id, str) or len(query_id) > 64:
        raise ConfigurationError("query_id must be a string of at most 64 characters")
    sql = SqlSpec.of(url, engine_options)
    columns = set(sql.table(table, schema).columns.keys())
    unknown = sorted(set(df.columns) - columns)
    if unknown:
        raise ConfigurationError(
            f"table {table!r} has no column(s) {unknown}; select the table's columns "
            "before append_rows"
        )
    ledger = partition_ledger_table(ledger_table)
    engine = sql.engine()
    if not _sql.create_table(engine, ledger):
        _add_call_id(engine, ledger)
    append = _Append(sql, table, schema, ledger_table, check_sink_id(sink_id), query_id,
                     batch_id, uuid.uuid4().hex)
    out = f"{_PARTITION} int, {_ROWS} long, {_STATE} tinyint"
    # one row per partition, summed here: no aggregation stage (and shuffle) after it
    outcomes = df.mapInArrow(append, out).collect()
    _forget_old(engine, ledger, append)
    return AppendResult(rows=sum(int(o[1]) for o in outcomes),
                        partitions=sum(o[2] == _WRITTEN for o in outcomes),
                        skipped=sum(o[2] == _SKIPPED for o in outcomes))


def _forget_old(engine: sa.Engine, ledger: sa.Table, append: _Append) -> None:
    """Delete the ledger rows of batches older than the last ``RETAIN``, every
    ``RETAIN`` batches."""
    if not append.batch_id or append.batch_id % RETAIN:
        return
    c = ledger.c
    with engine.begin() as conn:
        conn.execute(sa.delete(ledger).where(
            c.sink_id == append.sink_id, c.query_id == append.query_id,
            c.batch_id <= append.batch_id - RETAIN))
