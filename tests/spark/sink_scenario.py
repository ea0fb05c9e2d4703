"""The sinks as the quick start uses them, end to end on any session: a stream of order
events with resends, a driver crash before Spark's commit (the last ``commits/N``
deleted) and a restart. Run in-process (classic local, Spark Connect) or as a script
whose driver is on a standalone cluster:

    python sink_scenario.py <master URL> <work dir> <database URL>

prints the final state as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).parent))

from spark_streams import FileStream, appended, event, events_table, orders_table, read_table

from msgpatterns.idempotency import CheckerSpec
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

#: What the tables hold at the end, whatever the session.
EXPECTED: dict[str, Any] = {
    "orders": {"o1": [2, "s2"], "o2": [2, "s2"], "o3": [2, "s2"], "o4": [1, "s1"]},
    "payments": sorted([["o1:v1", 1], ["o2:v1", 1], ["o1:v2", 2], ["o3:v1", 1],
                        ["o2:v2", 2], ["o3:v2", 2], ["o4:v1", 1]]),
    "batches": [0, 1, 2, 3],
}


def quick_start(url: str, ledger: BatchLedger, checker: CheckerSpec,
                checkpoint: str) -> IdempotentBatch:
    """The docs' pattern: latest state by upsert, resent payments dropped, the rest
    appended once per partition; the whole batch once per query."""

    def write(df: DataFrame, batch_id: int) -> None:
        upsert_latest(df.select("order_id", "version", "status"), url, "orders",
                      key="order_id", version="version")
        with dedup_rows(df, checker, key="event_id") as fresh:
            append_rows(fresh.df.select("event_id", "order_id", "version"), url, "payments",
                        sink_id="payments", batch_id=batch_id, checkpoint=checkpoint)

    return idempotent_batch(write, ledger, "orders", checkpoint=checkpoint)


def run(spark: SparkSession, root: Path, url: str) -> dict[str, Any]:
    """The stream, a replayed batch and one more batch; the final state."""
    engine = sa.create_engine(url)
    orders, payments = orders_table("orders"), events_table("payments")
    orders.create(engine)
    payments.create(engine)
    ledger = BatchLedger(url, table="batches")
    checker = CheckerSpec("sql", url, {"lease": 120})
    stream = FileStream(spark, root)
    stream.add(event("o1", 1), event("o2", 1))
    stream.add(event("o1", 2), event("o2", 1), event("o3", 1))   # o2 v1 resent
    stream.add(event("o2", 2), event("o1", 1), event("o3", 2))   # o1 v1 resent
    sink = quick_start(url, ledger, checker, str(stream.checkpoint))
    query_id = stream.run(sink)
    stream.drop_last_commit()
    stream.run(sink)  # batch 2 again: skipped
    stream.add(event("o4", 1), event("o3", 1))
    stream.run(sink)
    state = {
        "orders": {k: list(v) for k, v in read_table(engine, orders).items()},
        "payments": sorted([list(p) for p in appended(engine, payments)]),
        "batches": sorted(b for b in range(10) if ledger.is_recorded("orders", query_id, b)),
    }
    engine.dispose()
    return state


if __name__ == "__main__":
    from msgpatterns.spark.local import local_spark
    from msgpatterns.spark.servers import cluster_conf_for

    master, workdir, database = sys.argv[1:4]
    session = local_spark(master, app_name="msgpatterns-cluster-tests",
                          conf=cluster_conf_for(master))
    try:
        print(json.dumps(run(session, Path(workdir), database)))
    finally:
        session.stop()
