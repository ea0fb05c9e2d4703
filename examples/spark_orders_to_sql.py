"""Spark Structured Streaming to SQL, exactly once: the latest status of every order.

A file source streams JSON order events: versions arrive out of order and some events
are sent twice. Each micro-batch goes through ``foreachBatch``:

* ``upsert_latest`` keeps the newest version per order inside the batch (in Spark) and
  writes it from the executors; a row is only ever replaced by a newer version.
* ``idempotent_batch`` records each written batch in a ledger table and skips a batch
  Spark runs again.

After the first run the script deletes the checkpoint's last commit file - as if the
driver had died after the write and before Spark's commit - and restarts the query:
Spark re-runs that batch and the ledger skips it. Then it checks the table.

    python examples/spark_orders_to_sql.py                 # SQLite in a temporary file
    python examples/spark_orders_to_sql.py postgresql+psycopg://postgres@127.0.0.1/test
    DATABASE_URL=postgresql+psycopg://... python examples/spark_orders_to_sql.py

Needs Java 17+ and ``pip install msgpatterns[spark]``; runs offline in local mode.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from pyspark.sql import DataFrame

from msgpatterns.spark import BatchLedger, idempotent_batch, upsert_latest
from msgpatterns.spark.local import drop_last_commit, local_spark

SCHEMA = "order_id STRING, status STRING, version BIGINT"
TABLE = "example_spark_orders"

# Three files, one micro-batch each. o1's "shipped" (v3) comes before its "paid" (v2);
# o2's "created" is sent twice; o3 is paid in the first file and created in the last.
FILES = [
    [("o1", "created", 1), ("o1", "shipped", 3), ("o2", "created", 1), ("o3", "paid", 2)],
    [("o1", "paid", 2), ("o2", "created", 1), ("o2", "paid", 2), ("o4", "created", 1)],
    [("o2", "shipped", 3), ("o3", "created", 1), ("o4", "paid", 2), ("o4", "created", 1)],
]
EXPECTED = {"o1": ("shipped", 3), "o2": ("shipped", 3), "o3": ("paid", 2), "o4": ("paid", 2)}


def create_table(url: str) -> sa.Engine:
    engine = sa.create_engine(url)
    table = sa.Table(
        TABLE, sa.MetaData(),
        sa.Column("order_id", sa.String(32), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
    )
    table.drop(engine, checkfirst=True)
    table.create(engine)
    return engine


def main(url: str, workdir: Path) -> bool:
    engine = create_table(url)
    ledger = BatchLedger(url, table="example_spark_batches")
    ledger.forget("orders-latest")  # a fresh start when the database is reused

    def write(df: DataFrame, batch_id: int) -> None:
        result = upsert_latest(df, url, TABLE, key="order_id", version="version")
        print(f"batch {batch_id}: {result.rows} events, {result.keys} orders, "
              f"{result.written} rows written, {result.stale} stale")

    source, checkpoint = workdir / "events", workdir / "checkpoint"
    # the checkpoint is where a Spark Connect session finds the query id (a classic
    # session is told it); the same code runs on both
    sink = idempotent_batch(write, ledger, sink_id="orders-latest", checkpoint=str(checkpoint))

    source.mkdir()
    for number, events in enumerate(FILES):
        path = source / f"events-{number}.json"
        path.write_text("".join(json.dumps(dict(zip(("order_id", "status", "version"), e,
                                                    strict=True))) + "\n" for e in events))
        os.utime(path, (1_700_000_000 + number,) * 2)  # the file source reads by mtime

    spark = local_spark("local[2]", app_name="spark-orders-to-sql")
    try:
        for attempt in ("first run", "restart after a crash before the commit"):
            print(f"-- {attempt}")
            query = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1)
                     .json(str(source)).writeStream.foreachBatch(sink)
                     .option("checkpointLocation", str(checkpoint))
                     .trigger(availableNow=True).start())
            query.awaitTermination()
            if attempt == "first run":
                print(f"(deleting commits/{drop_last_commit(checkpoint)}: the driver 'died')")
    finally:
        spark.stop()

    with engine.connect() as conn:
        rows: dict[str, Any] = {r.order_id: (r.status, r.version) for r in
                                conn.execute(sa.text(f"SELECT * FROM {TABLE}"))}
    engine.dispose()
    print(f"batches written {sink.stats.written}, replayed batches skipped {sink.stats.skipped}")
    for order_id in sorted(rows):
        print(f"  {order_id}: {rows[order_id][0]} (v{rows[order_id][1]})")
    exact = rows == EXPECTED and sink.stats.skipped == 1
    print("Final table exact: newest version of every order, replay skipped" if exact
          else f"MISMATCH: expected {EXPECTED}")
    return exact


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="spark-orders-") as tmp:
        db = (sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DATABASE_URL")
              or f"sqlite:///{Path(tmp) / 'orders.db'}")
        sys.exit(0 if main(db, Path(tmp)) else 1)
