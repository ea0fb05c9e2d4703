"""Batching: Flusher throughput, flush latency and bulk inserts, each against a baseline
measured in the same run.

1. Throughput: one producer, no-op processor, one worker: Flusher vs a hand-written
   ``queue.Queue`` + thread batcher. Goal: ours >= 1.0x the baseline's items/s.
2. Flush latency at a low rate (batches never fill): time from ``add`` to the start of
   the processor call, p50/p99. Goal: p99 <= flush_interval + 5 ms. For comparison
   only, the same arrivals through a thread that flushes everything every interval.
3. PostgreSQL: 100k rows through a Flusher (batch 500) with the library's processor,
   ``SqlSink`` (COPY on psycopg 3), vs single-row inserts, both as a handler would do
   them (one transaction per message) and all in one transaction. Goal: >= 10x the
   rows/s of single-row inserts. Also reported: the Flusher with a hand-written
   processor (SQLAlchemy Core executemany) against the same baselines, and the same
   batches written by a plain loop (the Flusher's own cost).
4. PostgreSQL (psycopg 3): the same 100k rows through a Flusher whose processor is
   ``SqlSink`` (each batch by COPY) vs a hand loop of executemany of the same batches,
   one transaction per batch in both. Goal: > 1.0x (reported: the ratio).

    python benchmarks/bench_batching.py [--items N] [--repeats R] [--rows N]
        [--postgres-url URL] [--skip-postgres]
"""

from __future__ import annotations

import argparse
import queue
import random
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from _bench import bench_line, best_of, timed

from msgpatterns import Flusher
from msgpatterns.sql_sink import SqlSink
from msgpatterns.testing import services

BATCH = 100
INTERVAL = 0.05
CAPACITY = 10_000
_STOP = object()


def noop(batch: list[Any]) -> None:
    pass


# -- 1. throughput ------------------------------------------------------------------


def flusher_throughput(n: int) -> float:
    """Seconds for one producer to push ``n`` items through a Flusher and drain it."""
    flusher: Flusher[int] = Flusher("bench", BATCH, INTERVAL, CAPACITY, 1, noop)

    def run() -> None:
        add = flusher.add
        for i in range(n):
            add(i, 60.0)
        flusher.close()

    elapsed = timed(run)
    assert flusher.counters.processed == n
    return elapsed


class QueueBatcher:
    """The usual hand-written batcher: a bounded queue.Queue and a thread that takes the
    first item, then more until the batch is full or the interval has passed."""

    def __init__(self, process: Callable[[list[Any]], None], batch_size: int,
                 interval: float, capacity: int) -> None:
        self.queue: queue.Queue[Any] = queue.Queue(capacity)
        self.process = process
        self.batch_size = batch_size
        self.interval = interval
        self.processed = 0
        self.thread = threading.Thread(target=self._run, name="queue-batcher")
        self.thread.start()

    def put(self, item: Any) -> None:
        self.queue.put(item)

    def close(self) -> None:
        self.queue.put(_STOP)
        self.thread.join()

    def _run(self) -> None:
        get = self.queue.get
        while True:
            item = get()
            if item is _STOP:
                return
            batch = [item]
            deadline = time.monotonic() + self.interval
            stopping = False
            while len(batch) < self.batch_size:
                left = deadline - time.monotonic()
                try:
                    item = get(timeout=left) if left > 0 else self.queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                    break
                batch.append(item)
            self.process(batch)
            self.processed += len(batch)
            if stopping:
                return


def queue_throughput(n: int) -> float:
    batcher = QueueBatcher(noop, BATCH, INTERVAL, CAPACITY)

    def run() -> None:
        put = batcher.put
        for i in range(n):
            put(i)
        batcher.close()

    elapsed = timed(run)
    assert batcher.processed == n
    return elapsed


# -- 2. latency ---------------------------------------------------------------------


class PeriodicFlusher:
    """A common hand-written alternative: a thread that flushes everything every interval."""

    def __init__(self, process: Callable[[list[Any]], None], interval: float) -> None:
        self.lock = threading.Lock()
        self.items: list[Any] = []
        self.process = process
        self.interval = interval
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="periodic-flusher")
        self.thread.start()

    def add(self, item: Any) -> None:
        with self.lock:
            self.items.append(item)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            with self.lock:
                batch, self.items = self.items, []
            if batch:
                self.process(batch)
        if self.items:
            self.process(self.items)


def paced_latencies(make: Callable[[Callable[[list[Any]], None]], Any],
                    seconds: float, rate: float, seed: int) -> list[float]:
    """Add timestamps at ``rate`` per second (Poisson arrivals) for ``seconds``; returns
    each item's wait from add to the start of its processor call."""
    waits: list[float] = []

    def record(batch: list[Any]) -> None:
        now = time.perf_counter()
        waits.extend(now - added for added in batch)

    helper = make(record)
    rng = random.Random(seed)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        helper.add(time.perf_counter())
        time.sleep(rng.expovariate(rate))
    helper.close()
    return waits


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000, method="inclusive")[round(q * 1000) - 1]


# -- 3. PostgreSQL ------------------------------------------------------------------


def rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    return [{"id": i, "key": f"order-{i}", "amount": i % 997} for i in range(start, start + n)]


def make_table(engine: sa.Engine) -> sa.Table:
    table = sa.Table(
        f"bench_batching_{uuid.uuid4().hex[:10]}",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("amount", sa.Integer, nullable=False),
    )
    table.create(engine)
    return table


def count(engine: sa.Engine, table: sa.Table) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def flusher_insert(engine: sa.Engine, table: sa.Table, data: list[dict[str, Any]]) -> float:
    def bulk_insert(batch: list[dict[str, Any]]) -> None:
        with engine.begin() as conn:
            conn.execute(table.insert(), batch)

    flusher: Flusher[dict[str, Any]] = Flusher("pg-bench", 500, INTERVAL, 5000, 2, bulk_insert)

    def run() -> None:
        for row in data:
            flusher.add(row, 60.0)
        assert flusher.close()

    elapsed = timed(run)
    assert flusher.counters.errors == 0
    return elapsed


def flusher_sql_sink(engine: sa.Engine, table: sa.Table, data: list[dict[str, Any]]) -> float:
    flusher: Flusher[dict[str, Any]] = Flusher("pg-sink", 500, INTERVAL, 5000, 2,
                                               SqlSink(engine, table))

    def run() -> None:
        for row in data:
            flusher.add(row, 60.0)
        assert flusher.close()

    elapsed = timed(run)
    assert flusher.counters.errors == 0
    return elapsed


def direct_executemany(engine: sa.Engine, table: sa.Table, data: list[dict[str, Any]]) -> float:
    """The same batches written by a plain loop: what the Flusher itself costs."""
    def run() -> None:
        insert = table.insert()
        for i in range(0, len(data), 500):
            with engine.begin() as conn:
                conn.execute(insert, data[i:i + 500])

    return timed(run)


def single_row_per_transaction(engine: sa.Engine, table: sa.Table,
                               data: list[dict[str, Any]]) -> float:
    def run() -> None:
        insert = table.insert()
        for row in data:
            with engine.begin() as conn:
                conn.execute(insert, row)

    return timed(run)


def single_row_one_transaction(engine: sa.Engine, table: sa.Table,
                               data: list[dict[str, Any]]) -> float:
    def run() -> None:
        insert = table.insert()
        with engine.begin() as conn:
            for row in data:
                conn.execute(insert, row)

    return timed(run)


def bench_postgres(url: str, n: int, baseline_rows: int, repeats: int) -> None:
    engine = sa.create_engine(url, pool_size=4)
    try:
        with engine.connect():
            pass
    except sa.exc.OperationalError as exc:
        print(f"PostgreSQL unreachable at {url}, skipping the insert benchmark: {exc}")
        return
    tables: list[sa.Table] = []

    def fresh() -> sa.Table:
        tables.append(make_table(engine))
        return tables[-1]

    try:
        data = rows(n)
        ours_s = []
        for _ in range(repeats):
            table = fresh()
            ours_s.append(flusher_insert(engine, table, data))
            assert count(engine, table) == n
        ours = n / min(ours_s)
        sink_s, hand_s = [], []
        for _ in range(repeats):  # interleaved: both see the same machine load
            table = fresh()
            hand_s.append(direct_executemany(engine, table, data))
            assert count(engine, table) == n
            table = fresh()
            sink_s.append(flusher_sql_sink(engine, table, data))
            assert count(engine, table) == n
        sink, hand = n / min(sink_s), n / min(hand_s)
        direct = n / best_of(repeats, lambda: direct_executemany(engine, fresh(), data))
        sample = rows(baseline_rows)
        per_tx = baseline_rows / best_of(
            repeats, lambda: single_row_per_transaction(engine, fresh(), sample)
        )
        one_tx = baseline_rows / best_of(
            repeats, lambda: single_row_one_transaction(engine, fresh(), sample)
        )
    finally:
        for table in tables:
            table.drop(engine)
        engine.dispose()
    print(
        f"postgres: Flusher(batch 500, executemany) {ours:,.0f} rows/s; single-row inserts "
        f"{per_tx:,.0f} rows/s (one transaction each), {one_tx:,.0f} rows/s (one transaction);"
        f" the same batches from a plain loop {direct:,.0f} rows/s"
    )
    print(f"postgres: Flusher + SqlSink (COPY) {sink:,.0f} rows/s; a hand loop of executemany "
          f"(batches of 500) {hand:,.0f} rows/s: {sink / hand:.2f}x")
    bench_line("batching", "flusher_sql_sink_vs_hand_executemany_rows_per_s", sink, hand,
               sink / hand, "> 1.0x", sink / hand > 1.0, rows=n, batch_size=500,
               driver=engine.dialect.driver)
    print(f"postgres: Flusher + SqlSink {sink / one_tx:.1f}x single rows in one transaction; "
          f"Flusher + hand executemany {ours / one_tx:.1f}x")
    for metric, baseline in (("rows_per_s_vs_single_row_per_transaction", per_tx),
                             ("rows_per_s_vs_single_row_one_transaction", one_tx)):
        bench_line("batching", metric, sink, baseline, sink / baseline, ">= 10x",
                   sink / baseline >= 10, rows=n, baseline_rows=baseline_rows,
                   processor="SqlSink", driver=engine.dialect.driver,
                   direct_executemany_rows_per_s=round(direct))
        bench_line("batching", f"executemany_{metric}", ours, baseline, ours / baseline,
                   "reported (no goal)", True, rows=n, baseline_rows=baseline_rows,
                   processor="hand-written executemany")


# -- main ---------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--items", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-seconds", type=float, default=2.0)
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--baseline-rows", type=int, default=5_000)
    parser.add_argument("--postgres-url", default=services.url("postgres"))
    parser.add_argument("--skip-postgres", action="store_true")
    args = parser.parse_args()

    n = args.items
    ours = n / best_of(args.repeats, lambda: flusher_throughput(n))
    base = n / best_of(args.repeats, lambda: queue_throughput(n))
    print(f"throughput: Flusher {ours:,.0f} items/s, queue.Queue batcher {base:,.0f} items/s")
    bench_line("batching", "flusher_items_per_s", ours, base, ours / base, ">= 1.0x",
               ours / base >= 1.0, items=n, batch_size=BATCH)

    p50s, p99s, base_p99s = [], [], []
    for seed in range(args.repeats):
        waits = paced_latencies(
            lambda p: Flusher("latency", BATCH, INTERVAL, CAPACITY, 1, p),
            args.latency_seconds, args.rate, seed,
        )
        p50s.append(percentile(waits, 0.50))
        p99s.append(percentile(waits, 0.99))
        periodic = paced_latencies(
            lambda p: PeriodicFlusher(p, INTERVAL), args.latency_seconds, args.rate, seed
        )
        base_p99s.append(percentile(periodic, 0.99))
    p50, p99, base_p99 = (statistics.median(v) for v in (p50s, p99s, base_p99s))
    goal = INTERVAL + 0.005
    print(
        f"latency at {args.rate:g} items/s, interval {INTERVAL * 1000:g} ms: p50 "
        f"{p50 * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms (periodic flusher p99 "
        f"{base_p99 * 1000:.2f} ms)"
    )
    bench_line("batching", "flush_latency_p99_ms", p99 * 1000, base_p99 * 1000,
               p99 / base_p99, f"p99 <= {goal * 1000:g} ms", p99 <= goal,
               p50_ms=round(p50 * 1000, 3), interval_ms=INTERVAL * 1000, rate=args.rate)

    if not args.skip_postgres:
        bench_postgres(args.postgres_url, args.rows, args.baseline_rows, args.repeats)


if __name__ == "__main__":
    main()
