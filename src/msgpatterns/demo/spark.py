"""``msgpatterns demo --spark``: the order-status pipeline on Spark Structured Streaming.

Order events (``created -> paid -> shipped -> delivered``, versions 1..4) are written
as JSON files: versions shuffled within a window, some events resent in a later file,
a few malformed lines. A streaming query reads the files, one micro-batch per file,
and its ``foreachBatch`` function - wrapped in
:func:`~msgpatterns.spark.idempotent_batch` - does three things:

* the latest status per order, with :func:`~msgpatterns.spark.upsert_latest` (an older
  version never overwrites a newer one; written from the executors);
* one payment row per paid order, appended from the executors after
  :func:`~msgpatterns.spark.dedup_rows` dropped resent events, each partition exactly
  once with :func:`~msgpatterns.spark.append_rows`;
* malformed lines to a dead-letter table, with the reason.

Between runs the driver "dies" after a batch's write and before Spark's commit (the
last ``commits/N`` file is deleted): Spark re-runs that batch and the ledger skips it.
At the end the tables are checked against what the events imply.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from msgpatterns.demo.console import STEPS, Console, DemoResult
from msgpatterns.idempotency.sql import SqlChecker
from msgpatterns.spark.append import append_rows, partition_ledger_table
from msgpatterns.spark.batch import IdempotentBatch, idempotent_batch
from msgpatterns.spark.dedup import dedup_rows
from msgpatterns.spark.ledger import BatchLedger
from msgpatterns.spark.local import drop_last_commit, local_spark
from msgpatterns.spark.resources import SqlSpec
from msgpatterns.spark.upsert import upsert_latest

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

__all__ = ["check", "plan_feed", "run_spark_demo"]

SCHEMA = ("order_id STRING, status STRING, version BIGINT, amount_cents BIGINT, "
          "event_id STRING, _corrupt_record STRING")
#: Files the events are spread over (one micro-batch each), and files per run.
FILES = 8
FILES_PER_RUN = 2


@dataclass
class Feed:
    """The events as written to files, and the final state they imply."""

    files: list[list[str]]
    events: int
    resent: int
    malformed: int
    expected: dict[str, Any] = field(default_factory=dict)


def plan_feed(orders: int, malformed: int, duplicate_rate: float, reorder_window: int,
              rng: random.Random, files: int = FILES) -> Feed:
    """Every order's events, shuffled within ``reorder_window``, some resent later, spread
    over ``files`` files with ``malformed`` broken lines among them."""
    events: list[dict[str, Any]] = []
    expected_orders: dict[str, tuple[str, int]] = {}
    expected_paid: dict[str, int] = {}
    for n in range(orders):
        order_id, steps, amount = f"order-{n:05d}", rng.randint(1, len(STEPS)), \
            rng.randint(100, 100_000)
        for version in range(1, steps + 1):
            events.append({"event_id": f"{order_id}:v{version}", "order_id": order_id,
                           "status": STEPS[version - 1], "version": version,
                           "amount_cents": amount})
        expected_orders[order_id] = (STEPS[steps - 1], steps)
        if steps >= 2:
            expected_paid[order_id] = amount
    window = max(1, reorder_window)
    for start in range(0, len(events), window):
        chunk = events[start:start + window]
        rng.shuffle(chunk)
        events[start:start + window] = chunk
    per_file = max(1, math.ceil(len(events) / files))
    lines = [json.dumps(e) for e in events]
    resent = 0
    for index, event in enumerate(events):
        if rng.random() < duplicate_rate:  # the source sends it again, a bit later
            later = min(len(lines), index + resent + rng.randint(1, 2 * per_file))
            lines.insert(later, json.dumps(event))
            resent += 1
    for _ in range(malformed):
        lines.insert(rng.randrange(len(lines) + 1), '{"order_id": "broken", "status": ')
    per_file = max(1, math.ceil(len(lines) / files))
    chunks = [lines[i:i + per_file] for i in range(0, len(lines), per_file)]
    return Feed(chunks, len(events), resent, malformed,
                {"orders": expected_orders, "payments": expected_paid})


@dataclass
class Tables:
    """The demo's tables in one database."""

    url: str
    prefix: str
    engine: sa.Engine = field(init=False)
    orders: sa.Table = field(init=False)
    payments: sa.Table = field(init=False)
    dead_letters: sa.Table = field(init=False)

    def __post_init__(self) -> None:
        self.engine = SqlSpec.of(self.url).engine()
        meta = sa.MetaData()
        self.orders = sa.Table(
            f"{self.prefix}orders", meta,
            sa.Column("order_id", sa.String(64), primary_key=True),
            sa.Column("status", sa.String(16), nullable=False),
            sa.Column("version", sa.BigInteger, nullable=False),
        )
        self.payments = sa.Table(  # no unique key: a resent event would pay twice
            f"{self.prefix}payments", meta,
            sa.Column("event_id", sa.String(80), nullable=False),
            sa.Column("order_id", sa.String(64), nullable=False),
            sa.Column("amount_cents", sa.BigInteger, nullable=False),
        )
        self.dead_letters = sa.Table(
            f"{self.prefix}dead_letters", meta,
            sa.Column("batch_id", sa.BigInteger, nullable=False),
            sa.Column("line", sa.Text, nullable=False),
            sa.Column("reason", sa.String(200), nullable=False),
        )
        partition_ledger_table(f"{self.prefix}partitions", meta)  # append_rows' ledger
        self.metadata = meta

    def recreate(self) -> None:
        if self.engine.dialect.name == "sqlite":
            with self.engine.connect() as conn:  # writers and readers side by side
                conn.exec_driver_sql("PRAGMA journal_mode=WAL")
        self.metadata.drop_all(self.engine)
        self.metadata.create_all(self.engine)

    def final_state(self) -> dict[str, Any]:
        with self.engine.connect() as conn:
            orders = {r.order_id: (r.status, r.version)
                      for r in conn.execute(sa.select(self.orders))}
            paid: dict[str, list[int]] = {}
            for r in conn.execute(sa.select(self.payments)):
                paid.setdefault(r.order_id, []).append(r.amount_cents)
            dead = conn.execute(sa.select(sa.func.count()).select_from(self.dead_letters))
            return {"orders": orders, "payments": paid, "dead_letters": dead.scalar_one()}


@dataclass
class Counts:
    batches: int = 0
    written: int = 0
    stale: int = 0
    resent_dropped: int = 0


def build_sink(tables: Tables, ledger: BatchLedger, checker: SqlChecker,
               counts: Counts) -> IdempotentBatch:
    """The foreachBatch function: orders, payments and dead letters, once per batch."""
    from pyspark.sql import functions as F

    checker_spec = checker.spec()

    def write(df: DataFrame, batch_id: int) -> None:
        df.persist()
        try:
            valid = (F.col("_corrupt_record").isNull() & F.col("order_id").isNotNull()
                     & F.col("version").isNotNull())
            bad = df.where(~valid)
            good = df.where(valid).drop("_corrupt_record")
            result = upsert_latest(good.select("order_id", "status", "version"), tables.url,
                                   tables.orders.name, key="order_id", version="version")
            paid = good.where(F.col("status") == "paid")
            with dedup_rows(paid, checker_spec, key="event_id", group="payments",
                            sink_id="demo-payments", batch_id=batch_id) as fresh:
                # each partition's rows commit with its ledger row: a re-attempted task
                # or a replayed batch appends nothing twice
                append_rows(fresh.df.select("event_id", "order_id", "amount_cents"),
                            tables.url, tables.payments.name, sink_id="demo-payments",
                            batch_id=batch_id, ledger_table=f"{tables.prefix}partitions")
            dead = [{"batch_id": batch_id, "line": r["_corrupt_record"] or json.dumps(
                r.asDict()), "reason": "malformed JSON or missing order_id/version"}
                for r in bad.collect()]
            if dead:
                with tables.engine.begin() as conn:
                    conn.execute(tables.dead_letters.insert(), dead)
        finally:
            df.unpersist()
        counts.batches += 1
        counts.written += result.written
        counts.stale += result.stale
        counts.resent_dropped += fresh.stats.dropped

    return idempotent_batch(write, ledger, sink_id="msgpatterns-spark-demo")


def check(expected: dict[str, Any], actual: dict[str, Any], malformed: int) -> list[str]:
    """What differs between the tables and the state the events imply."""
    problems = []
    wrong = [k for k, v in expected["orders"].items() if actual["orders"].get(k) != v]
    if wrong:
        problems.append(f"{len(wrong)} order(s) in the wrong state, e.g. {wrong[:3]}")
    extra = sorted(set(actual["orders"]) - set(expected["orders"]))
    if extra:
        problems.append(f"unexpected orders: {extra[:3]}")
    twice = [k for k, v in actual["payments"].items() if len(v) > 1]
    if twice:
        problems.append(f"{len(twice)} order(s) paid more than once, e.g. {twice[:3]}")
    if {k: v[0] for k, v in actual["payments"].items()} != expected["payments"]:
        problems.append("the payment ledger differs from the expected one")
    if actual["dead_letters"] != malformed:
        problems.append(f"{actual['dead_letters']} dead letter(s), expected {malformed}")
    return problems


@contextmanager
def _session(workers: int) -> Iterator[SparkSession]:
    """The active SparkSession if there is one (left running), else a local one."""
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        yield active
        return
    cores = max(1, min(workers, os.cpu_count() or 1))
    session = local_spark(f"local[{cores}]", app_name="msgpatterns-spark-demo")
    try:
        yield session
    finally:
        session.stop()


def run_spark_demo(args: argparse.Namespace) -> bool:
    """Run the Spark pipeline, print a summary; True when the final state is exact.

    ``args`` are ``msgpatterns demo``'s options: orders, malformed, duplicate_rate,
    reorder_window, lost_ack_rate (chance that the driver dies before Spark's commit
    after a run; the first run always does when it is above 0), seed, workers (local
    cores), db (SQLAlchemy URL; default a SQLite file), no_progress.
    """
    console = Console(None)
    rng = random.Random(args.seed)
    feed = plan_feed(args.orders, args.malformed, args.duplicate_rate, args.reorder_window,
                     rng, files=getattr(args, "files", FILES))
    prefix = getattr(args, "table_prefix", "spark_demo_")
    with tempfile.TemporaryDirectory(prefix="msgpatterns-spark-demo-") as workdir, \
            _session(args.workers) as spark:
        root = Path(workdir)
        tables = Tables(args.db or f"sqlite:///{root / 'demo.db'}", prefix)
        tables.recreate()
        ledger = BatchLedger(tables.engine, table=f"{prefix}batches")
        ledger.drop_table()
        checker = SqlChecker(tables.url, table=f"{prefix}dedup", lease=120)
        checker.store.table.drop()
        counts = Counts()
        sink = build_sink(tables, ledger, checker, counts)
        source, checkpoint = root / "events", root / "checkpoint"
        source.mkdir()
        crashes, started = 0, time.perf_counter()
        for run, first in enumerate(range(0, len(feed.files), FILES_PER_RUN)):
            for number in range(first, min(first + FILES_PER_RUN, len(feed.files))):
                path = source / f"events-{number:03d}.json"
                path.write_text("\n".join(feed.files[number]) + "\n")
                os.utime(path, (1_700_000_000 + number,) * 2)  # files are read by mtime
            _run_stream(spark, source, checkpoint, sink)
            lost = args.lost_ack_rate > 0 and (run == 0 or rng.random() < args.lost_ack_rate)
            if lost and first + FILES_PER_RUN < len(feed.files):
                drop_last_commit(checkpoint)
                crashes += 1
            if not args.no_progress:
                console.print(f"  run {run + 1}: {counts.batches} batch(es) written, "
                              f"{sink.stats.skipped} replayed batch(es) skipped")
        wall = time.perf_counter() - started
        actual = tables.final_state()
        checker.close()
    problems = check(feed.expected, actual, feed.malformed)
    summary: dict[str, Any] = {
        "events (files)": f"{feed.events:,} ({len(feed.files)})",
        "resent by the source": feed.resent,
        "malformed lines": feed.malformed,
        "micro-batches written": counts.batches,
        "driver crashes before Spark's commit": crashes,
        "replayed batches skipped (ledger)": sink.stats.skipped,
        "order rows written (newer version)": counts.written,
        "stale or repeated versions ignored": counts.stale,
        "resent payments dropped (dedup_rows)": counts.resent_dropped,
        "dead letters (malformed lines)": actual["dead_letters"],
        "wall time": f"{wall:.1f} s",
    }
    result = DemoResult(feed.events, feed.malformed, summary, problems)
    console.summary(result, feed.expected, [])
    return result.exact


def _run_stream(spark: SparkSession, source: Path, checkpoint: Path,
                sink: Callable[[DataFrame, int], None]) -> None:
    query = (
        spark.readStream.schema(SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .option("mode", "PERMISSIVE")
        .option("columnNameOfCorruptRecord", "_corrupt_record")
        .json(str(source))
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    try:
        query.awaitTermination()
    finally:
        query.stop()

