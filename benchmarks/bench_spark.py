"""Spark sinks: upsert_latest against PostgreSQL's own limit, and how it scales with cores.

1. PostgreSQL, ``--rows`` rows (1M; distinct keys in scrambled order), every row an
   update (the table holds each key at version 0 before every run): ``upsert_latest``
   (Spark keeps the newest row per key, then executors COPY chunks of ``--chunk`` rows,
   upsert_latest's default, into a staging table and write each with one ``INSERT ...
   SELECT ... ON CONFLICT DO UPDATE ... WHERE version <``, one transaction per chunk)
   vs the database's own limit measured with psycopg 3 directly in the same run: the
   same rows, already in the driver's memory, COPYed in one stream into a temporary
   staging table plus ONE ``INSERT ... SELECT ... ON CONFLICT DO UPDATE ... WHERE
   version <``. Both sides also print their CPU per row: Spark's processes (driver,
   executors, their Python workers) plus the backends serving upsert_latest, vs the
   client thread plus its backend.
   The same measure on each of ``--sessions``: ``local`` (``local[2]``), ``cluster``
   (a standalone master and two 1-core workers started from the pyspark package) and
   ``connect`` (a Spark Connect server on ``local[2]``), each against the limit measured
   in the same run. Goals: local[2] >= 0.9x the limit, cluster >= 0.8x local[2],
   Connect >= 0.8x classic local[2]. The sessions run one after another, so the last
   two compare rates measured at different times; ``normalized`` in their lines
   compares each session's ratio to its own same-run limit instead.
2. Rows/s of ``upsert_latest`` on ``local[1]`` vs ``local[2]`` (``--scale-rows`` rows,
   same setup; 0 skips it). Goal: >= 1.4x. (This machine has two cores and also runs
   PostgreSQL.)

    python benchmarks/bench_spark.py [--rows N] [--scale-rows N] [--repeats R]
        [--chunk N] [--postgres-url URL] [--sessions local,cluster,connect]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa
from _bench import bench_line, timed

from msgpatterns.spark import UpsertResult, upsert_latest
from msgpatterns.spark.local import local_spark
from msgpatterns.testing import services

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: upsert_latest's default batch_size.
CHUNK = 10_000


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


def fresh_table(engine: sa.Engine, table: sa.Table) -> None:
    table.drop(engine, checkfirst=True)
    table.create(engine)


def raw_url(url: str) -> str:
    """The libpq URL (no SQLAlchemy driver suffix) for psycopg.connect."""
    return sa.engine.make_url(url).set(drivername="postgresql").render_as_string(
        hide_password=False)


def key_order(rows: int) -> list[int]:
    return [(i * 7919) % rows for i in range(rows)]


def prefill(url: str, table: str, rows: int) -> None:
    """Every key at version 0 (so each benchmarked row is an update), VACUUMed."""
    import psycopg

    with psycopg.connect(raw_url(url), autocommit=True) as conn:
        conn.execute(f"TRUNCATE {table}")
        with conn.cursor() as cur, cur.copy(
                f"COPY {table} (order_id, version, status, amount) FROM STDIN") as copy:
            for key in range(rows):
                copy.write_row((key, 0, "s", 0))
        conn.execute(f"VACUUM ANALYZE {table}")


#: The application_name of upsert_latest's connections (its backends are found by it).
APP = "bench_spark_upsert_latest"
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the live processes ``pids`` have used."""
    total = 0.0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # gone
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        total += (int(fields[11]) + int(fields[12])) / _TICK
    return total


class Cpu:
    """CPU seconds of the Spark side (process trees: driver, executors, their Python
    workers, this process) and of PostgreSQL's backends serving ``APP``."""

    def __init__(self, url: str, roots: Callable[[], list[int]]) -> None:
        self.url = url
        self.roots = roots

    def spark(self) -> float:
        from msgpatterns.spark.servers import descendants

        pids = [tree for root in self.roots() for tree in (root, *descendants(root))]
        return cpu_seconds(pids) + time.process_time()

    def backends(self) -> float:
        import psycopg

        with psycopg.connect(raw_url(self.url), autocommit=True) as conn:
            pids = [int(r[0]) for r in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (APP,))]
        return cpu_seconds(pids)

    def now(self) -> tuple[float, float]:
        return self.spark(), self.backends()


def copy_staging_upsert(url: str, table: str,
                        data: list[tuple[int, int, str, int]]) -> tuple[float, float]:
    """psycopg 3 directly: COPY ``data`` into a temporary staging table, then ONE
    INSERT ... SELECT ... ON CONFLICT DO UPDATE ... WHERE version <. (Seconds, CPU
    seconds of this thread and of the backend.)"""
    import psycopg

    with psycopg.connect(raw_url(url)) as conn:
        backend = conn.info.backend_pid
        cpu = time.thread_time() + cpu_seconds([backend])
        start = time.perf_counter()
        conn.execute(f"CREATE TEMPORARY TABLE stage ON COMMIT DROP AS "
                     f"SELECT order_id, version, status, amount FROM {table} WITH NO DATA")
        with conn.cursor() as cur, cur.copy(
                "COPY stage (order_id, version, status, amount) FROM STDIN") as copy:
            for row in data:
                copy.write_row(row)
        written = conn.execute(
            f"INSERT INTO {table} (order_id, version, status, amount) "
            "SELECT order_id, version, status, amount FROM stage "
            "ON CONFLICT (order_id) DO UPDATE SET version = excluded.version, "
            "status = excluded.status, amount = excluded.amount "
            f"WHERE {table}.version IS NULL OR {table}.version < excluded.version").rowcount
        conn.commit()
        elapsed = time.perf_counter() - start
        cpu = time.thread_time() + cpu_seconds([backend]) - cpu
    assert written == len(data), (written, len(data))
    return elapsed, cpu


def versus_copy_baseline(spark: SparkSession, url: str, rows: int, repeats: int,
                         chunk: int, roots: Callable[[], list[int]], label: str = "local[2]",
                         partitions: int = 2) -> tuple[float, float]:
    """(upsert_latest rows/s, limit rows/s), best of ``repeats``, interleaved; prints
    the CPU per row of each (least of the repeats): Spark's processes and the
    backends for upsert_latest, the client thread and its backend for the limit."""
    engine = sa.create_engine(url)
    table = orders(f"bench_spark_{uuid.uuid4().hex[:8]}")
    df = events(spark, rows, partitions)
    data = [(key, i % 5 + 1, f"s{i % 5}", i % 10_000)
            for i, key in enumerate(key_order(rows))]
    meter = Cpu(url, roots)
    options = {"connect_args": {"application_name": APP}}

    def upsert(frame: DataFrame) -> UpsertResult:
        return upsert_latest(frame, url, table.name, key="order_id", version="version",
                             batch_size=chunk, engine_options=options)

    def ours() -> tuple[float, float]:
        prefill(url, table.name, rows)
        before = meter.now()
        start = time.perf_counter()
        result = upsert(df)
        elapsed = time.perf_counter() - start
        after = meter.now()
        assert result.written == rows, result
        return elapsed, sum(after) - sum(before)

    def baseline() -> tuple[float, float]:
        prefill(url, table.name, rows)
        return copy_staging_upsert(url, table.name, data)

    try:
        fresh_table(engine, table)
        upsert(events(spark, 1000, partitions))  # start the Python workers first
        ours_runs, base_runs = [], []
        for _ in range(repeats):  # interleaved: both see the same machine load
            base_runs.append(baseline())
            ours_runs.append(ours())
        ours_rate = rows / min(t for t, _ in ours_runs)
        base_rate = rows / min(t for t, _ in base_runs)
        ours_cpu = min(c for _, c in ours_runs) / rows * 1e6
        base_cpu = min(c for _, c in base_runs) / rows * 1e6
        print(f"{label}: upsert_latest {rows:,} rows (all updates): {ours_rate:,.0f} rows/s "
              f"(runs {_fmt(ours_runs)} s), CPU {ours_cpu:.1f} us/row; psycopg 3 COPY to "
              f"staging + one INSERT ... SELECT ... ON CONFLICT: {base_rate:,.0f} rows/s "
              f"(runs {_fmt(base_runs)} s), CPU {base_cpu:.1f} us/row; load average "
              f"{os.getloadavg()[0]:.1f}")
        ratio = ours_rate / base_rate
        goal = 0.9 if label == "local[2]" else 0.0
        bench_line("spark", f"upsert_latest_vs_copy_staging_upsert_rows_per_s[{label}]",
                   ours_rate, base_rate, ratio, f">= {goal}x" if goal else "reported",
                   ratio >= goal, rows=rows, chunk=chunk, unit="rows/s", driver="psycopg 3",
                   cpu_us_per_row=round(ours_cpu, 2), baseline_cpu_us_per_row=round(base_cpu, 2),
                   load=round(os.getloadavg()[0], 1))
        return ours_rate, base_rate
    finally:
        table.drop(engine, checkfirst=True)
        engine.dispose()


def rows_per_second(master: str, url: str, rows: int, repeats: int, chunk: int) -> float:
    """Best rows/s of upsert_latest on ``master``, every row an update."""
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
        best = float("inf")
        for _ in range(repeats):
            prefill(url, table.name, rows)
            best = min(best, timed(lambda: upsert_latest(
                df, url, table.name, key="order_id", version="version", batch_size=chunk)))
        return rows / best
    finally:
        table.drop(engine, checkfirst=True)
        engine.dispose()
        spark.stop()


def on_session(kind: str, args: argparse.Namespace) -> tuple[float, float]:
    """upsert_latest vs the limit on a ``local`` (local[2]), ``cluster`` (a standalone
    master and two 1-core workers) or ``connect`` (a Connect server on local[2])
    session started for the measure and stopped after it."""
    from msgpatterns.spark import servers

    measure = (args.postgres_url, args.rows, args.repeats, args.chunk)
    with tempfile.TemporaryDirectory(prefix="bench-spark-") as workdir:
        if kind == "local":
            spark = local_spark("local[2]", app_name="bench-spark", fast_start=False)
            driver = spark.sparkContext._gateway.proc.pid  # type: ignore[union-attr]
            try:
                return versus_copy_baseline(spark, *measure, lambda: [driver],
                                            label="local[2]")
            finally:
                spark.stop()
        if kind == "cluster":
            cluster = servers.start_cluster(Path(workdir))
            try:
                spark = local_spark(cluster.url, app_name="bench-spark", fast_start=False,
                                    conf=servers.cluster_conf_for(cluster.url, fast_start=False))
                driver = spark.sparkContext._gateway.proc.pid  # type: ignore[union-attr]
                processes = [driver, cluster.master.pid, *(w.pid for w in cluster.workers)]
                try:
                    return versus_copy_baseline(spark, *measure, lambda: processes,
                                                label="cluster (2x1 core)")
                finally:
                    spark.stop()
            finally:
                cluster.stop()
        if kind == "connect":
            from pyspark.sql import SparkSession

            server = servers.start_connect_server(Path(workdir), fast_start=False)
            marks = {name: os.environ.get(name) for name in servers.CONNECT_MARKS}
            try:
                remote = SparkSession.builder.remote(server.url).create()
                try:
                    return versus_copy_baseline(remote, *measure, lambda: [server.pid],
                                                label="Connect local[2]")
                finally:
                    remote.stop()
            finally:
                server.stop()
                # the classic sessions after this one must not be taken for Connect ones
                for name, value in marks.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
    raise SystemExit(f"unknown session kind {kind!r}: local, cluster or connect")


def _fmt(runs: list[tuple[float, float]]) -> str:
    return ", ".join(f"{t:.2f}" for t, _ in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--scale-rows", type=int, default=500_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=CHUNK)
    parser.add_argument("--postgres-url", default=services.url("postgres"))
    parser.add_argument("--sessions", default="local,cluster,connect")
    args = parser.parse_args()

    rates = {}
    for kind in args.sessions.split(","):
        rates[kind] = on_session(kind, args)
    if "local" in rates:
        local_rate, local_limit = rates["local"]
        for kind, goal in (("cluster", 0.8), ("connect", 0.8)):
            if kind in rates:
                rate, limit = rates[kind]
                ratio = rate / local_rate
                normalized = (rate / limit) / (local_rate / local_limit)
                print(f"upsert_latest {kind} vs classic local[2]: {ratio:.2f}x "
                      f"(each against its own same-run limit: {normalized:.2f}x)")
                bench_line("spark", f"upsert_latest_rows_per_s_{kind}_vs_local2",
                           rate, local_rate, ratio, f">= {goal}x", ratio >= goal,
                           rows=args.rows, chunk=args.chunk, unit="rows/s",
                           normalized=round(normalized, 3))
    if not args.scale_rows:
        return

    one = rows_per_second("local[1]", args.postgres_url, args.scale_rows, args.repeats,
                          args.chunk)
    two = rows_per_second("local[2]", args.postgres_url, args.scale_rows, args.repeats,
                          args.chunk)
    print(f"upsert_latest rows/s local[1] -> local[2]: {one:,.0f} -> {two:,.0f}")
    scale = two / one
    bench_line("spark", "upsert_latest_rows_per_s_local2_vs_local1", two, one, scale,
               ">= 1.4x", scale >= 1.4, rows=args.scale_rows, chunk=args.chunk,
               unit="rows/s")


if __name__ == "__main__":
    main()
