"""idempotent_batch: a foreachBatch function that writes each micro-batch once.

Spark's ``foreachBatch`` is at least once: if the driver dies after the sink wrote a
batch and before the checkpoint recorded it, the restarted query runs that batch again
with the same id and the same data. The wrapper asks a :class:`BatchLedger` first and
skips a batch the sink has already written.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

from msgpatterns.errors import ConfigurationError
from msgpatterns.spark.ledger import BatchLedger, check_sink_id

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from sqlalchemy import Connection

__all__ = ["BatchStats", "IdempotentBatch", "checkpoint_query_id", "idempotent_batch",
           "streaming_query_id"]

log = logging.getLogger("msgpatterns.spark")

#: The SparkContext local property holding the running query's id (set by Spark on
#: the thread that runs each micro-batch, and so visible inside foreachBatch).
QUERY_ID_PROPERTY = "sql.streaming.queryId"

Write = Callable[["DataFrame", int], Any]
TransactionalWrite = Callable[["DataFrame", int, "Connection"], Any]


def streaming_query_id(df: DataFrame, checkpoint: str | None = None) -> str:
    """The id of the streaming query whose micro-batch ``df`` is.

    Spark stores it in the checkpoint's ``metadata`` file: it survives restarts, and a
    new checkpoint gets a new one. On a classic session it is read from the
    ``foreachBatch`` thread's local property; on Spark Connect (whose ``foreachBatch``
    function runs on the server and is told no query id) from
    ``<checkpoint>/metadata``, read through the batch's own session (any file system
    Spark reads). Raises :class:`~msgpatterns.errors.ConfigurationError` outside
    ``foreachBatch``, and on Connect without ``checkpoint``.
    """
    try:
        context = df.sparkSession.sparkContext
    except Exception:  # Spark Connect: no SparkContext on this side
        context = None
    if context is not None:
        query_id = context.getLocalProperty(QUERY_ID_PROPERTY)
        if query_id:
            return str(query_id)
    if checkpoint is not None:
        return checkpoint_query_id(df, checkpoint)
    if context is None:
        raise ConfigurationError(
            "a Spark Connect foreachBatch function sees no streaming query id: pass "
            "checkpoint=<the query's checkpointLocation>, or key the ledger on the "
            "sink alone (BatchLedger(..., scope='sink'))"
        )
    raise ConfigurationError(
        "no streaming query id: call this from the foreachBatch function of a "
        "running streaming query"
    )


def checkpoint_query_id(df: DataFrame, checkpoint: str) -> str:
    """The query id kept in ``<checkpoint>/metadata`` (``{"id": "..."}``), read with
    ``df``'s session: a Spark job, so callers keep the answer."""
    path = f"{str(checkpoint).rstrip('/')}/metadata"
    try:
        first = df.sparkSession.read.text(path).first()
        query_id = json.loads(first[0])["id"] if first is not None else None
    except Exception as exc:
        raise ConfigurationError(
            f"cannot read the query id from {path}: is {checkpoint!r} the query's "
            f"checkpointLocation? ({type(exc).__name__})"
        ) from exc
    if not isinstance(query_id, str) or not query_id:
        raise ConfigurationError(f"{path} holds no query id")
    return query_id


@dataclass
class BatchStats:
    """What an :class:`IdempotentBatch` did in this process."""

    written: int = 0
    skipped: int = 0


class IdempotentBatch:
    """A ``foreachBatch`` function that runs ``write`` at most once per batch that
    completes; see :func:`idempotent_batch`."""

    def __init__(self, write: Write | TransactionalWrite, ledger: BatchLedger,
                 sink_id: str, *, transactional: bool, checkpoint: str | None = None) -> None:
        if not callable(write):
            raise ConfigurationError("write must be a function (df, batch_id[, conn])")
        if not isinstance(ledger, BatchLedger):
            raise ConfigurationError("ledger must be a BatchLedger")
        self.write = write
        self.ledger = ledger
        self.sink_id = sink_id
        self.transactional = transactional
        self.checkpoint = checkpoint
        self.stats = BatchStats()
        self._stats_lock = threading.Lock()
        self._query_ids: dict[str, str] = {}  # checkpoint -> its query id (it never changes)

    def __getstate__(self) -> dict[str, Any]:
        """Pickles (Spark Connect ships the foreachBatch function to the server): the
        ledger travels as its URL; the stats start again where it lands."""
        state = dict(self.__dict__)
        del state["_stats_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._stats_lock = threading.Lock()

    def query_id(self, df: DataFrame) -> str:
        """The query id the ledger keys this batch on ("" for a sink-scoped ledger)."""
        if self.ledger.scope == "sink":
            return self.ledger.query_key("")
        if self.checkpoint is not None and self.checkpoint in self._query_ids:
            return self._query_ids[self.checkpoint]
        query_id = streaming_query_id(df, self.checkpoint)
        if self.checkpoint is not None:
            self._query_ids[self.checkpoint] = query_id
        return query_id

    def __call__(self, df: DataFrame, batch_id: int) -> None:
        query_id = self.query_id(df)
        if self.transactional:
            done = self._write_in_transaction(df, batch_id, query_id)
        else:
            done = self._write_then_record(df, batch_id, query_id)
        with self._stats_lock:
            if done:
                self.stats.written += 1
            else:
                self.stats.skipped += 1
                log.info("sink %s: batch %d of query %s was written before; skipped",
                         self.sink_id, batch_id, query_id)

    def _write_then_record(self, df: DataFrame, batch_id: int, query_id: str) -> bool:
        if self.ledger.is_recorded(self.sink_id, query_id, batch_id):
            return False
        self.write(df, batch_id)  # type: ignore[call-arg]
        self.ledger.record(self.sink_id, query_id, batch_id)
        return True

    def _write_in_transaction(self, df: DataFrame, batch_id: int, query_id: str) -> bool:
        self.ledger.create_table()
        with self.ledger.engine.begin() as conn:
            # the ledger row first: a concurrent run of the same batch waits on its key
            if not self.ledger.record(self.sink_id, query_id, batch_id, conn=conn):
                return False
            self.write(df, batch_id, conn)  # type: ignore[call-arg]
        return True

    def __repr__(self) -> str:
        mode = ", transactional=True" if self.transactional else ""
        return f"idempotent_batch({self.write!r}, {self.ledger!r}, {self.sink_id!r}{mode})"


@overload
def idempotent_batch(write: Write, ledger: BatchLedger, sink_id: str, *,
                     transactional: Literal[False] = False,
                     checkpoint: str | None = None) -> IdempotentBatch: ...


@overload
def idempotent_batch(write: TransactionalWrite, ledger: BatchLedger, sink_id: str, *,
                     transactional: Literal[True],
                     checkpoint: str | None = None) -> IdempotentBatch: ...


def idempotent_batch(write: Write | TransactionalWrite, ledger: BatchLedger, sink_id: str,
                     *, transactional: bool = False,
                     checkpoint: str | None = None) -> IdempotentBatch:
    """Wrap ``write(df, batch_id)`` for ``foreachBatch`` so each batch is written once.

    Before a batch, the ledger is asked whether ``(sink_id, query_id, batch_id)`` was
    recorded; if so the batch is skipped. After ``write`` returns, the batch is
    recorded. The query id is the streaming query's (kept in its checkpoint): a
    restarted query keeps it, a new checkpoint starts a new one, so a reset checkpoint
    writes its batches instead of skipping them.

    Guarantees:

    * default: a batch whose write *and* record completed is never written again.
      If the driver dies between the two, the batch is written again on restart, so
      ``write`` must tolerate re-running a batch it finished or half-finished
      (:func:`~msgpatterns.spark.upsert_latest` does).
    * ``transactional=True``: ``write(df, batch_id, conn)`` gets the open transaction
      on the ledger's database; the ledger row is inserted first and commits with
      ``write``'s own statements, or rolls back with them. Exactly once for writes
      done through ``conn`` on the driver (collect the batch, or an aggregate of it).

    Cost per batch: one indexed lookup and one insert (transactional: one insert in
    the write's transaction). An empty batch costs the same two statements, which is
    cheaper than asking Spark whether it is empty (a job).

    ``sink_id`` names the target (keep it stable across deployments); two sinks of one
    query need two ids.

    ``checkpoint``: the query's ``checkpointLocation``. Needed on Spark Connect, whose
    ``foreachBatch`` function sees no query id: it is read once from the checkpoint's
    ``metadata`` file. A ledger with ``scope="sink"`` needs no query id at all. The
    wrapper pickles, so the same code runs on classic and Connect sessions (on
    Connect it runs on the server, and so do its ``stats``).
    """
    return IdempotentBatch(write, ledger, check_sink_id(sink_id), transactional=transactional,
                           checkpoint=checkpoint)
