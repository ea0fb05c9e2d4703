"""The sinks as the quick start uses them, end to end on any session: a stream of order
events with resends, a driver crash before Spark's commit (the last ``commits/N``
deleted) and a restart. Run in-process (classic local, Spark Connect) or as a script
whose driver (or Connect client) is a process of its own:

    python sink_scenario.py <master or sc:// URL> <work dir> <database URL> [phase]
        [--executor-loss ROWS]

prints the final state as JSON. The phase cuts the run where a test kills the driver:
``<batch>:<point>`` (a point of :func:`quick_start`, see :data:`KILL_POINTS`) starts
the stream, or restarts it from the checkpoint, and pauses the batch function there,
waiting to be killed; ``finish`` restarts it and runs to the end; ``all`` (the default)
runs the scenario whole. ``--executor-loss`` then runs ``executor_loss.run`` in the
same driver and prints its state as a second line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))

from spark_streams import FileStream, appended, event, events_table, orders_table, read_table

from msgpatterns.idempotency import CheckerSpec, checker_from_spec
from msgpatterns.spark import (
    BatchLedger,
    IdempotentBatch,
    append_rows,
    dedup_rows,
    idempotent_batch,
    upsert_latest,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: Every event the stream carries (resends aside).
EVENT_IDS = sorted(["o1:v1", "o2:v1", "o1:v2", "o3:v1", "o2:v2", "o3:v2", "o4:v1"])

#: What the tables hold at the end, whatever the session and wherever the driver died.
EXPECTED: dict[str, Any] = {
    "orders": {"o1": [2, "s2"], "o2": [2, "s2"], "o3": [2, "s2"], "o4": [1, "s1"]},
    "payments": sorted([[e, int(e[-1])] for e in EVENT_IDS]),
    "batches": [0, 1, 2, 3],
    # rows each batch appended, by the partition ledger (a resend adds nothing)
    "partition_rows": {"0": 2, "1": 2, "2": 2, "3": 1},
    "dedup": ["done"] * len(EVENT_IDS),
}

#: Where the tests kill the driver, as phases: batch 1 once its rows are appended, before
#: dedup_rows marks their keys DONE and before the ledger records the batch (on the
#: cluster); batch 2 once its keys are claimed, before anything is written (on Connect).
#: Batch 3 resends events of both.
KILL_POINTS = ("1:appended", "2:claimed")

#: Seconds a paused batch waits to be killed before it fails the run.
PAUSE_LIMIT = 600.0

Pause = Callable[[int, str], None]


def no_pause(batch_id: int, point: str) -> None:
    """The batch function's hook when nobody kills the driver."""


class PauseAt:
    """The hook that stops the batch function at ``(batch, point)``: it writes
    ``<marks>/paused-<batch>-<point>`` (holding its pid) and waits to be killed."""

    def __init__(self, marks: Path, batch_id: int, point: str) -> None:
        self.marks = str(marks)
        self.at = (batch_id, point)

    def __call__(self, batch_id: int, point: str) -> None:
        if (batch_id, point) != self.at:
            return
        Path(self.marks, f"paused-{batch_id}-{point}").write_text(str(os.getpid()))
        deadline = time.monotonic() + PAUSE_LIMIT
        while time.monotonic() < deadline:  # the test kills the driver in here
            time.sleep(0.1)
        raise RuntimeError(f"batch {batch_id} was paused at {point!r} and never killed")


def quick_start(url: str, ledger: BatchLedger, checker: CheckerSpec, checkpoint: str,
                pause: Pause = no_pause) -> IdempotentBatch:
    """The docs' pattern: latest state by upsert, resent payments dropped, the rest
    appended once per partition; the whole batch once per query."""

    def write(df: DataFrame, batch_id: int) -> None:
        upsert_latest(df.select("order_id", "version", "status"), url, "orders",
                      key="order_id", version="version")
        with dedup_rows(df, checker, key="event_id", sink_id="payments", batch_id=batch_id,
                        checkpoint=checkpoint) as fresh:
            pause(batch_id, "claimed")
            append_rows(fresh.df.select("event_id", "order_id", "version"), url, "payments",
                        sink_id="payments", batch_id=batch_id, checkpoint=checkpoint)
            pause(batch_id, "appended")

    return idempotent_batch(write, ledger, "orders", checkpoint=checkpoint)


def prepare(spark: SparkSession, root: Path, url: str) -> FileStream:
    """The tables and the first three batches' files."""
    engine = sa.create_engine(url)
    orders_table("orders").create(engine)
    events_table("payments").create(engine)
    engine.dispose()
    stream = FileStream(spark, root)
    stream.add(event("o1", 1), event("o2", 1))
    stream.add(event("o1", 2), event("o2", 1), event("o3", 1))   # o2 v1 resent
    stream.add(event("o2", 2), event("o1", 1), event("o3", 2))   # o1 v1 resent
    return stream


def sink_for(stream: FileStream, url: str, pause: Pause = no_pause) -> IdempotentBatch:
    return quick_start(url, BatchLedger(url, table="batches"),
                       CheckerSpec("sql", url, {"lease": 120}), str(stream.checkpoint), pause)


def run(spark: SparkSession, root: Path, url: str, phase: str = "all") -> dict[str, Any]:
    """The stream, a replayed batch and one more batch; the final state. A
    ``<batch>:<point>`` phase never returns: it waits to be killed mid-batch."""
    if (root / "events").exists():
        stream = FileStream(spark, root, resume=True)  # a restarted driver
    else:
        stream = prepare(spark, root, url)
    if phase not in ("all", "finish"):
        batch, point = phase.split(":")
        stream.run(sink_for(stream, url, PauseAt(root, int(batch), point)))
        raise RuntimeError(f"phase {phase} ended without pausing")
    sink = sink_for(stream, url)
    query_id = stream.run(sink)
    stream.drop_last_commit()
    stream.run(sink)  # batch 2 again: skipped
    stream.add(event("o4", 1), event("o3", 1), event("o2", 2))  # o3 v1, o2 v2 resent
    stream.run(sink)
    return state(url, query_id)


def state(url: str, query_id: str) -> dict[str, Any]:
    """The tables, the batch ledger, the partition ledger and the checker's marks."""
    engine = sa.create_engine(url)
    ledger = BatchLedger(url, table="batches")
    with engine.connect() as conn:
        partition_rows = {str(batch): int(rows) for batch, rows in conn.execute(sa.text(
            "SELECT batch_id, sum(row_count) FROM msgpatterns_partitions "
            "WHERE sink_id = 'payments' GROUP BY batch_id"))}
    checker = checker_from_spec(CheckerSpec("sql", url, {"lease": 120}))
    marks = [claim.status.value for claim in checker.claim_many(EVENT_IDS)]
    checker.close()
    found = {
        "orders": {k: list(v) for k, v in read_table(engine, orders_table("orders")).items()},
        "payments": sorted([list(p) for p in appended(engine, events_table("payments"))]),
        "batches": sorted(b for b in range(10) if ledger.is_recorded("orders", query_id, b)),
        "partition_rows": partition_rows,
        "dedup": marks,
    }
    engine.dispose()
    return found


def main(argv: list[str]) -> None:
    import argparse

    import executor_loss
    import spark_streams
    from pyspark import cloudpickle

    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("workdir", type=Path)
    parser.add_argument("database")
    parser.add_argument("phase", nargs="?", default="all")
    parser.add_argument("--executor-loss", type=int, default=0, metavar="ROWS")
    args = parser.parse_args(argv)
    # on Connect the batch function runs in the server's Python worker, which cannot
    # import the test helpers: they travel by value (as this script's own functions do)
    for module in (spark_streams, executor_loss):
        cloudpickle.register_pickle_by_value(module)  # type: ignore[no-untyped-call]
    if args.target.startswith("sc://"):
        from pyspark.sql import SparkSession

        session = SparkSession.builder.remote(args.target).create()
    else:
        from msgpatterns.spark.local import local_spark
        from msgpatterns.spark.servers import cluster_conf_for

        session = local_spark(args.target, app_name="msgpatterns-cluster-tests",
                              conf=cluster_conf_for(args.target))
    try:
        print(json.dumps(run(session, args.workdir, args.database, args.phase)), flush=True)
        if args.executor_loss:
            marks = args.workdir / "executor-loss"
            marks.mkdir()
            print(json.dumps(executor_loss.run(session, args.database, args.executor_loss,
                                               marks)), flush=True)
    finally:
        session.stop()


if __name__ == "__main__":
    main(sys.argv[1:])
