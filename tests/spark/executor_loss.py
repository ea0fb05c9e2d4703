"""A batch that loses an executor JVM mid-write, as a driver on a standalone cluster:

    python executor_loss.py <master URL> <database URL> <rows>

dedup_rows claims ``rows`` events (8 partitions), append_rows writes them, one partition
at a time per executor, slowly; the test ``kill -9``s an executor JVM once some
partitions committed. Prints the final state as JSON: the rows in the table, the
distinct event ids, what append_rows and a resend of the same events found.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import sqlalchemy as sa

if TYPE_CHECKING:
    import pyarrow as pa


def slowly(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Each partition takes a while, so the kill lands mid-batch."""
    time.sleep(1.5)
    yield from batches


def main(master: str, url: str, rows: int) -> dict[str, object]:
    from msgpatterns.idempotency import CheckerSpec
    from msgpatterns.spark import append_rows, dedup_rows
    from msgpatterns.spark.local import local_spark
    from msgpatterns.spark.servers import cluster_conf_for

    spark = local_spark(master, app_name="msgpatterns-executor-loss", shuffle_partitions=8,
                        conf=cluster_conf_for(master))
    try:
        events = spark.range(rows).selectExpr(
            "concat('e', id) AS event_id", "concat('o', id % 97) AS order_id",
            "CAST(1 AS BIGINT) AS version")
        checker = CheckerSpec("sql", url, {"lease": 300, "table": "loss_dedup"})
        with dedup_rows(events, checker, key="event_id") as fresh:
            written = append_rows(fresh.df.mapInArrow(slowly, fresh.df.schema), url,
                                  "loss_payments", sink_id="payments", batch_id=0,
                                  query_id="q", ledger_table="loss_partitions")
        resent = dedup_rows(events, checker, key="event_id")
        resent.release()
    finally:
        spark.stop()
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        total, distinct = conn.execute(sa.text(
            "SELECT count(*), count(DISTINCT event_id) FROM loss_payments")).one()
    engine.dispose()
    return {"rows": total, "distinct": distinct, "appended": written.rows,
            "skipped_partitions": written.skipped, "resent_kept": resent.stats.kept,
            "resent_dropped": resent.stats.dropped}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
