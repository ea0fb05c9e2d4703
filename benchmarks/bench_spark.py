"""Spark sinks: upsert_latest against a plain insert, and how it scales with cores.

1. PostgreSQL, ``--rows`` rows (1M; distinct keys in scrambled order): ``upsert_latest``
   (Spark keeps the newest row per key, then executors write chunks of 1000 with
   ``VersionGuard.upsert_latest_many``) vs a plain ``foreachPartition`` that INSERTs
   the same rows in chunks of 1000 with SQLAlchemy Core ``executemany`` (psycopg2,
   insertmanyvalues), one transaction per chunk in both. Both start from an empty table.
   Goal: ours takes at most 1.3x the baseline's time.
2. Rows/s on ``local[1]`` vs ``local[2]`` (``--scale-rows`` rows) for ``upsert_latest``,
   with the plain insert's figures for context. Goal: two cores are faster than one.
   (This machine has two cores and also runs PostgreSQL: one writer - a Python worker
   plus its PostgreSQL backend - already keeps much of both busy, and under load from
   other work neither sink gains from the second core.)

    python benchmarks/bench_spark.py [--rows N] [--scale-rows N] [--repeats R]
        [--postgres-url URL]
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Iterator
from itertools import islice
from typing import TYPE_CHECKING

import sqlalchemy as sa
from _bench import bench_line, timed

from msgpatterns.spark import SqlSpec, upsert_latest
from msgpatterns.spark.local import local_spark
from msgpatterns.testing import services

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, Row, SparkSession

CHUNK = 1000


def orders(name: str) -> sa.Table:
    return sa.Table(
        name, sa.MetaData(),
        sa.Column("order_id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("amount", sa.BigInteger, nullable=False),
    )


def events(spark: SparkSession, rows: int, partitions: int) -> DataFrame:
    """``rows`` events with distinct keys in a scrambled order (7919 is prime, so
    ``id * 7919 % rows`` is a permutation unless 7919 divides ``rows``)."""
    from pyspark.sql import functions as F

    ids = spark.range(rows, numPartitions=partitions)
    return ids.select(
        ((F.col("id") * 7919) % rows).alias("order_id"),
        (F.col("id") % 5 + 1).alias("version"),
        F.concat(F.lit("s"), (F.col("id") % 5).cast("string")).alias("status"),
        (F.col("id") % 10_000).alias("amount"),
    )


class PlainInsert:
    """The baseline ``foreachPartition``: INSERT chunks of rows, nothing else."""

    def __init__(self, url: str, table: str) -> None:
        self.spec = SqlSpec.of(url)
        self.table = table

    def __call__(self, rows: Iterator[Row]) -> None:
        table = self.spec.table(self.table)
        records = (r.asDict() for r in rows)
        with self.spec.engine().connect() as conn:
            while chunk := list(islice(records, CHUNK)):
                with conn.begin():
                    conn.execute(table.insert(), chunk)


def fresh_table(engine: sa.Engine, table: sa.Table) -> None:
    table.drop(engine, checkfirst=True)
    table.create(engine)


def count(engine: sa.Engine, table: sa.Table) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def versus_plain_insert(spark: SparkSession, url: str, rows: int, repeats: int) -> None:
    engine = sa.create_engine(url)
    table = orders(f"bench_spark_{uuid.uuid4().hex[:8]}")
    partitions = spark.sparkContext.defaultParallelism
    df = events(spark, rows, partitions)

    def ours() -> float:
        fresh_table(engine, table)
        elapsed = timed(lambda: upsert_latest(df, url, table.name, key="order_id",
                                              version="version", batch_size=CHUNK))
        assert count(engine, table) == rows
        return elapsed

    def baseline() -> float:
        fresh_table(engine, table)
        elapsed = timed(lambda: df.foreachPartition(PlainInsert(url, table.name)))
        assert count(engine, table) == rows
        return elapsed

    try:
        small = events(spark, 1000, partitions)  # start the Python workers first
        fresh_table(engine, table)
        upsert_latest(small, url, table.name, key="order_id", version="version")
        ours_times, base_times = [], []
        for _ in range(repeats):  # interleaved: both see the same machine load
            base_times.append(baseline())
            ours_times.append(ours())
        best_ours, best_base = min(ours_times), min(base_times)
        print(f"upsert_latest {rows:,} rows: {best_ours:.2f} s (runs {_fmt(ours_times)}); "
              f"plain insert: {best_base:.2f} s (runs {_fmt(base_times)})")
        ratio = best_ours / best_base
        bench_line("spark", "upsert_latest_vs_plain_insert_time", best_ours, best_base, ratio,
                   "<= 1.3x", ratio <= 1.3, rows=rows, unit="s")
    finally:
        table.drop(engine, checkfirst=True)
        engine.dispose()


def rows_per_second(master: str, url: str, rows: int, repeats: int) -> tuple[float, float]:
    """Best rows/s of upsert_latest and of the plain insert on ``master``."""
    cores = int(master[len("local["):-1])
    spark = local_spark(master, app_name="bench-spark", shuffle_partitions=cores,
                        fast_start=False)
    engine = sa.create_engine(url)
    table = orders(f"bench_spark_{uuid.uuid4().hex[:8]}")
    try:
        df = events(spark, rows, cores)
        fresh_table(engine, table)
        upsert_latest(events(spark, 1000, cores), url, table.name, key="order_id",
                      version="version")
        ours = plain = float("inf")
        for _ in range(repeats):
            fresh_table(engine, table)
            plain = min(plain, timed(lambda: df.foreachPartition(PlainInsert(url, table.name))))
            fresh_table(engine, table)
            ours = min(ours, timed(lambda: upsert_latest(df, url, table.name, key="order_id",
                                                         version="version")))
        return rows / ours, rows / plain
    finally:
        table.drop(engine, checkfirst=True)
        engine.dispose()
        spark.stop()


def _fmt(times: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--scale-rows", type=int, default=500_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--postgres-url", default=services.url("postgres"))
    args = parser.parse_args()

    spark = local_spark("local[2]", app_name="bench-spark", fast_start=False)
    versus_plain_insert(spark, args.postgres_url, args.rows, args.repeats)
    spark.stop()

    one, plain_one = rows_per_second("local[1]", args.postgres_url, args.scale_rows,
                                     args.repeats)
    two, plain_two = rows_per_second("local[2]", args.postgres_url, args.scale_rows,
                                     args.repeats)
    print(f"rows/s local[1] -> local[2]: upsert_latest {one:,.0f} -> {two:,.0f}; "
          f"plain insert {plain_one:,.0f} -> {plain_two:,.0f}")
    ours_scale, plain_scale = two / one, plain_two / plain_one
    bench_line("spark", "upsert_latest_rows_per_s_local2_vs_local1", two, one, ours_scale,
               "> 1.0x (uses the second core)", ours_scale > 1.0,
               rows=args.scale_rows, unit="rows/s", plain_insert_ratio=round(plain_scale, 3))

if __name__ == "__main__":
    main()

