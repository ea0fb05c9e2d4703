"""Ordering: OrderedExecutor overhead and parallelism, batch vs row-by-row upserts.

1. Submit throughput, no-op tasks: OrderedExecutor vs concurrent.futures.ThreadPoolExecutor
   with the same number of threads (submit everything, wait for everything).
   Goal: ours >= 0.5x the pool's tasks/s (the price of per-key order).
2. A 1 ms I/O-bound handler (``time.sleep(0.001)``) over many keys: 8 lanes vs 1 lane.
   Goal: >= 6x the tasks/s.
3. PostgreSQL: ``VersionGuard.upsert_latest_many`` (psycopg 3: COPY into a staging
   table + one ``INSERT ... SELECT ... ON CONFLICT``) vs ``upsert_latest`` row by row
   (a) in the same single transaction - goal >= 3x the rows/s - and (b) one
   transaction per row, as a handler without batching does - goal >= 10x; and (c) vs
   its own executemany path (used below ``COPY_MIN_ROWS`` rows and on other drivers),
   same rows - goal > 1.0x.

    python benchmarks/bench_ordering.py [--tasks N] [--io-tasks N] [--rows N]
        [--repeats R] [--postgres-url URL] [--skip-postgres]
"""

from __future__ import annotations

import argparse
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, wait

import sqlalchemy as sa
from _bench import bench_line, best_of, timed

from msgpatterns.ordering import OrderedExecutor, VersionGuard
from msgpatterns.ordering import version_guard as version_guard_module
from msgpatterns.testing import services

THREADS = 4


def noop() -> None:
    pass


def ordered_noops(tasks: int, lanes: int) -> float:
    keys = [f"key-{i}" for i in range(1000)]

    def run() -> None:
        with OrderedExecutor(lanes) as executor:
            submit = executor.submit
            for i in range(tasks):
                submit(keys[i % 1000], noop)

    return timed(run)


def pool_noops(tasks: int, threads: int) -> float:
    def run() -> None:
        with ThreadPoolExecutor(threads) as pool:
            submit = pool.submit
            for _ in range(tasks):
                submit(noop)

    return timed(run)


def ordered_io(tasks: int, lanes: int) -> float:
    def run() -> None:
        with OrderedExecutor(lanes) as executor:
            wait([executor.submit(f"order-{i}", time.sleep, 0.001) for i in range(tasks)])

    return timed(run)


def bench_postgres(url: str, rows: int, repeats: int) -> None:
    engine = sa.create_engine(url)
    metadata = sa.MetaData()
    table = sa.Table(
        f"bench_latest_{uuid.uuid4().hex[:8]}", metadata,
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("payload", sa.Text),
        sa.Column("version", sa.Integer),
    )
    guard = VersionGuard(table, "id", "version")
    metadata.create_all(engine)
    generation = iter(range(1, 1_000_000))
    try:
        def batch() -> None:
            version = next(generation)
            data = [{"id": f"k{i}", "payload": f"p{version}", "version": version}
                    for i in range(rows)]
            with engine.begin() as conn:
                assert guard.upsert_latest_many(conn, data) == rows

        def row_by_row() -> None:
            version = next(generation)
            with engine.begin() as conn:
                for i in range(rows):
                    guard.upsert_latest(conn, f"k{i}", version, {"payload": f"p{version}"})

        def row_per_transaction() -> None:
            version = next(generation)
            for i in range(rows):
                with engine.begin() as conn:
                    guard.upsert_latest(conn, f"k{i}", version, {"payload": f"p{version}"})

        def batch_executemany() -> None:
            saved = version_guard_module.COPY_MIN_ROWS
            version_guard_module.COPY_MIN_ROWS = rows + 1  # below the COPY threshold
            try:
                batch()
            finally:
                version_guard_module.COPY_MIN_ROWS = saved

        batch()  # create the rows: every run then overwrites existing ones
        ours = rows / best_of(repeats, lambda: timed(batch))
        many = rows / best_of(repeats, lambda: timed(batch_executemany))
        same_txn = rows / best_of(repeats, lambda: timed(row_by_row))
        per_txn = rows / best_of(repeats, lambda: timed(row_per_transaction))
    finally:
        metadata.drop_all(engine)
        engine.dispose()
    print(f"postgres: upsert_latest_many {ours:,.0f} rows/s; row by row {same_txn:,.0f} rows/s "
          f"in one transaction, {per_txn:,.0f} rows/s with a transaction per row")
    print(f"postgres: upsert_latest_many by COPY {ours:,.0f} rows/s, by executemany "
          f"{many:,.0f} rows/s")
    bench_line("ordering", "upsert_latest_many_copy_vs_executemany_rows_per_s", ours, many,
               ours / many, "> 1.0x", ours / many > 1.0, rows=rows)
    bench_line("ordering", "upsert_latest_many_vs_rows_one_txn_rows_per_s", ours, same_txn,
               ours / same_txn, ">= 3x", ours / same_txn >= 3, rows=rows)
    bench_line("ordering", "upsert_latest_many_vs_txn_per_row_rows_per_s", ours, per_txn,
               ours / per_txn, ">= 10x", ours / per_txn >= 10, rows=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tasks", type=int, default=100_000)
    parser.add_argument("--io-tasks", type=int, default=2_000)
    parser.add_argument("--rows", type=int, default=2_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--postgres-url", default=services.url("postgres"))
    parser.add_argument("--skip-postgres", action="store_true")
    args = parser.parse_args()

    n = args.tasks
    ours = n / best_of(args.repeats, lambda: ordered_noops(n, THREADS))
    base = n / best_of(args.repeats, lambda: pool_noops(n, THREADS))
    print(f"no-op tasks, {THREADS} threads: OrderedExecutor {ours:,.0f}/s, "
          f"ThreadPoolExecutor {base:,.0f}/s")
    bench_line("ordering", "executor_noop_tasks_per_s", ours, base, ours / base, ">= 0.5x",
               ours / base >= 0.5, tasks=n, threads=THREADS)

    n = args.io_tasks
    repeats = max(1, args.repeats // 2)
    ours = n / best_of(repeats, lambda: ordered_io(n, 8))
    base = n / best_of(repeats, lambda: ordered_io(n, 1))
    print(f"1 ms handler: 8 lanes {ours:,.0f}/s, 1 lane {base:,.0f}/s")
    bench_line("ordering", "executor_io_tasks_per_s_8_vs_1_lane", ours, base, ours / base,
               ">= 6x", ours / base >= 6, tasks=n)

    if not args.skip_postgres:
        bench_postgres(args.postgres_url, args.rows, args.repeats)


if __name__ == "__main__":
    main()
