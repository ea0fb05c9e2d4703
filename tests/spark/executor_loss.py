"""A batch that loses an executor JVM mid-write, on a standalone cluster of two 1-core
workers (run by ``sink_scenario.py ... --executor-loss`` in its driver):

dedup_rows claims ``rows`` events (8 partitions) and append_rows writes them. The first
two write tasks to start go through; every later one first writes
``<marks>/held-<task>`` and waits for ``<marks>/release``. Once both executors hold
such a task (so the first two partitions committed: an executor runs one task at a
time), the test ``kill -9``s one executor JVM and writes the release file. Spark re-runs
what died with the executor: the held task, and the cached claims (with the shuffle
output under them) that the commit reads, which dedup_rows claims again with the same
owner. :func:`run` returns the
final state: the rows in the table, the distinct event ids, the rows the partition
ledger counts, what append_rows and a resend of the same events found.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

#: Write tasks that go through before the kill; the later ones wait for the release.
FREE_TASKS = 2
#: Seconds a held task waits for the release file before failing.
HOLD_LIMIT = 600.0


class HoldLaterTasks:
    """``mapInArrow`` before the write: the tasks that start after the first two wait
    for the test's release file (nothing of theirs is written meanwhile). The first
    two take a slot file each (created exclusively), whatever their partitions."""

    def __init__(self, marks: Path) -> None:
        self.marks = str(marks)

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        context = TaskContext.get()
        assert context is not None
        task = f"{context.partitionId()}-{context.taskAttemptId()}"
        Path(self.marks, f"start-{task}").touch()
        release = Path(self.marks, "release")
        if not release.exists() and not self._free_slot():
            # the pids above this Python worker (its daemon, the executor JVM...)
            Path(self.marks, f"held-{task}").write_text(" ".join(map(str, ancestors())))
            deadline = time.monotonic() + HOLD_LIMIT
            while not release.exists():
                if time.monotonic() > deadline:
                    raise RuntimeError("the test never released the held partitions")
                time.sleep(0.05)
        yield from batches

    def _free_slot(self) -> bool:
        for slot in range(FREE_TASKS):
            try:
                Path(self.marks, f"free-{slot}").open("x").close()
            except FileExistsError:
                continue
            return True
        return False


def ancestors() -> list[int]:
    found, pid = [], os.getpid()
    while pid > 1:
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat[stat.rindex(")") + 2:].split()[1])
        found.append(pid)
    return found


def create_table(url: str) -> None:
    engine = sa.create_engine(url)
    sa.Table("loss_payments", sa.MetaData(), sa.Column("event_id", sa.String(40)),
             sa.Column("order_id", sa.String(40)), sa.Column("version", sa.BigInteger)
             ).create(engine)
    engine.dispose()


def run(spark: SparkSession, url: str, rows: int, marks: Path) -> dict[str, Any]:
    from msgpatterns.idempotency import CheckerSpec
    from msgpatterns.spark import append_rows, dedup_rows

    create_table(url)
    events = spark.range(rows, numPartitions=8).selectExpr(
        "concat('e', id) AS event_id", "concat('o', id % 97) AS order_id",
        "CAST(1 AS BIGINT) AS version")
    checker = CheckerSpec("sql", url, {"lease": 300, "table": "loss_dedup"})
    # 8 partitions after dedup_rows' shuffle, as before it
    previous = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", "8")
    try:
        with dedup_rows(events, checker, key="event_id", sink_id="loss", batch_id=0,
                        query_id="q") as fresh:
            held = fresh.df.mapInArrow(HoldLaterTasks(marks), fresh.df.schema)
            written = append_rows(held, url, "loss_payments", sink_id="payments", batch_id=0,
                                  query_id="q", ledger_table="loss_partitions")
        resent = dedup_rows(events, checker, key="event_id")
        resent.release()
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", str(previous))
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        total, distinct = conn.execute(sa.text(
            "SELECT count(*), count(DISTINCT event_id) FROM loss_payments")).one()
        ledgered = conn.execute(sa.text("SELECT sum(row_count) FROM loss_partitions")).scalar()
    engine.dispose()
    return {"rows": total, "distinct": distinct, "ledgered": ledgered,
            "appended": written.rows, "skipped_partitions": written.skipped,
            "resent_kept": resent.stats.kept, "resent_dropped": resent.stats.dropped}
