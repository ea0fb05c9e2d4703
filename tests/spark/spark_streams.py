"""Helpers of the Spark tests: a file-source stream of order events, tables, rows."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from msgpatterns.spark.local import drop_last_commit
from msgpatterns.spark.resources import SqlSpec

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row, SparkSession

#: The order events every stream test reads.
EVENT_SCHEMA = "order_id STRING, version BIGINT, status STRING, event_id STRING"


class FileStream:
    """Order events as JSON files, read by a streaming query with a checkpoint."""

    def __init__(self, spark: SparkSession, root: Path, *, resume: bool = False) -> None:
        """``resume``: the stream another process started under ``root`` (its files
        and checkpoint), as a restarted driver finds it."""
        self.spark = spark
        self.root = root
        self.source = root / "events"
        self.source.mkdir(exist_ok=resume)
        self.checkpoint = root / "checkpoint-0"
        self.files = len(list(self.source.glob("events-*.json")))

    def add(self, *events: dict[str, Any]) -> None:
        """One more file: the next micro-batch."""
        path = self.source / f"events-{self.files:04d}.json"
        path.write_text("".join(json.dumps(e) + "\n" for e in events))
        stamp = 1_700_000_000 + self.files  # the file source orders files by mtime
        os.utime(path, (stamp, stamp))
        self.files += 1

    def run(self, sink: Callable[[DataFrame, int], Any]) -> str:
        """Process every file not yet committed in the checkpoint; the query's id."""
        query = (
            self.spark.readStream.schema(EVENT_SCHEMA)
            .option("maxFilesPerTrigger", 1)
            .json(str(self.source))
            .writeStream.foreachBatch(sink)
            .option("checkpointLocation", str(self.checkpoint))
            .trigger(availableNow=True)
            .start()
        )
        try:
            query.awaitTermination(240)
        finally:
            query.stop()
        return str(query.id)

    def drop_last_commit(self) -> int:
        """Forget that the last batch committed, as if the driver died just before."""
        return drop_last_commit(self.checkpoint)

    def new_checkpoint(self) -> None:
        """Start over with an empty checkpoint (a reset): a new query id."""
        self.checkpoint = self.root / f"checkpoint-{uuid.uuid4().hex[:6]}"

    def reset(self) -> None:
        """A new checkpoint and a new, empty source: batch ids start again at 0."""
        self.new_checkpoint()
        self.source = self.root / f"events-{uuid.uuid4().hex[:6]}"
        self.source.mkdir()
        self.files = 0


def orders_table(name: str) -> sa.Table:
    """The latest state per order."""
    return sa.Table(
        name, sa.MetaData(),
        sa.Column("order_id", sa.String(64), primary_key=True),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
    )


def read_table(engine: sa.Engine, table: sa.Table) -> dict[str, tuple[int, str]]:
    with engine.connect() as conn:
        return {r.order_id: (r.version, r.status) for r in conn.execute(sa.select(table))}


def event(order_id: str, version: int, status: str = "", event_id: str = "") -> dict[str, Any]:
    return {"order_id": order_id, "version": version, "status": status or f"s{version}",
            "event_id": event_id or f"{order_id}:v{version}"}


def events_table(name: str) -> sa.Table:
    """An append-only sink: no key, so a batch written twice shows up twice."""
    return sa.Table(
        name, sa.MetaData(),
        sa.Column("event_id", sa.String(64), nullable=False),
        sa.Column("order_id", sa.String(64), nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
    )


class AppendRows:
    """``foreachPartition``: insert the partition's rows into ``table`` in one
    transaction - a plain append, at least once (a re-attempted task writes again)."""

    def __init__(self, url: str, table: str) -> None:
        self.spec = SqlSpec.of(url)
        self.table = table

    def __call__(self, rows: Iterator[Row]) -> None:
        records = [row.asDict() for row in rows]
        if records:
            with self.spec.engine().begin() as conn:
                conn.execute(self.spec.table(self.table).insert(), records)


def append_sink(url: str, table: sa.Table) -> Any:
    def write(df: DataFrame, batch_id: int) -> None:
        df.select("event_id", "order_id", "version").foreachPartition(
            AppendRows(url, table.name)
        )
    return write


def appended(engine: sa.Engine, table: sa.Table) -> list[tuple[str, int]]:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(table.c.event_id, table.c.version))
        return sorted((r.event_id, r.version) for r in rows)
