"""Exactly-once ``foreachBatch`` sinks for Spark Structured Streaming.

* :func:`idempotent_batch` with a :class:`BatchLedger` - skip a micro-batch the sink
  already wrote (Spark re-runs the last batch after a driver crash).
* :func:`upsert_latest` - the newest version of each key to a SQL table, written from
  the executors; re-runs and half-written batches are harmless.
* :func:`append_rows` - append a batch to a SQL table, each partition exactly once
  (its rows commit with a ledger row; a re-attempted task writes nothing).
* :func:`dedup_rows` - drop rows a Redis or SQL checker has seen DONE (sources that
  resend), and mark the rest once written.

Every part works on classic sessions (local and clusters) and on Spark Connect sessions
from the same code: the sink objects pickle, and only DataFrame and Arrow APIs are used.
Executors receive URLs and options, never live connections. Needs the ``[spark]``
extra (PySpark, SQLAlchemy); nothing is imported until first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgpatterns._extras import lazy_attributes

if TYPE_CHECKING:
    from msgpatterns.spark.append import AppendResult, append_rows
    from msgpatterns.spark.batch import (
        BatchStats,
        IdempotentBatch,
        checkpoint_query_id,
        idempotent_batch,
        streaming_query_id,
    )
    from msgpatterns.spark.dedup import DedupedRows, DedupStats, dedup_rows
    from msgpatterns.spark.ledger import BatchLedger
    from msgpatterns.spark.resources import SqlSpec
    from msgpatterns.spark.upsert import UpsertResult, upsert_latest

__all__ = [
    "AppendResult",
    "BatchLedger",
    "BatchStats",
    "DedupStats",
    "DedupedRows",
    "IdempotentBatch",
    "SqlSpec",
    "UpsertResult",
    "append_rows",
    "checkpoint_query_id",
    "dedup_rows",
    "idempotent_batch",
    "streaming_query_id",
    "upsert_latest",
]

_LAZY = {
    "AppendResult": "msgpatterns.spark.append",
    "append_rows": "msgpatterns.spark.append",
    "BatchLedger": "msgpatterns.spark.ledger",
    "BatchStats": "msgpatterns.spark.batch",
    "IdempotentBatch": "msgpatterns.spark.batch",
    "idempotent_batch": "msgpatterns.spark.batch",
    "checkpoint_query_id": "msgpatterns.spark.batch",
    "streaming_query_id": "msgpatterns.spark.batch",
    "DedupStats": "msgpatterns.spark.dedup",
    "DedupedRows": "msgpatterns.spark.dedup",
    "dedup_rows": "msgpatterns.spark.dedup",
    "SqlSpec": "msgpatterns.spark.resources",
    "UpsertResult": "msgpatterns.spark.upsert",
    "upsert_latest": "msgpatterns.spark.upsert",
}


__getattr__ = lazy_attributes(__name__, _LAZY)
