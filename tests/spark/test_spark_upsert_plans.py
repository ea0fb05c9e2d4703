"""upsert_latest's fast plan (an exchange by key, a sort, the first row of each key run
found with Arrow kernels) against its plain twin (``groupBy`` + ``max(struct)``):
the same table, the same counts, the same errors, on random batches full of ties,
nulls, NaN and signed zeros, cut into Arrow batches of 7 rows so key runs cross
batch boundaries."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa

from msgpatterns.errors import MalformedMessage
from msgpatterns.ordering.errors import MissingVersion
from msgpatterns.spark.latest import LatestRows
from msgpatterns.spark.upsert import _upsert

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark

SCHEMA = "region STRING, order_id BIGINT, version BIGINT, status STRING, amount DOUBLE"
COLUMNS = ["region", "order_id", "version", "status", "amount"]


def table(name: str) -> sa.Table:
    return sa.Table(
        name, sa.MetaData(),
        sa.Column("region", sa.String(16), primary_key=True),
        sa.Column("order_id", sa.BigInteger, primary_key=True, autoincrement=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("status", sa.String(16)),
        sa.Column("amount", sa.Float),
    )


def batch(rng: random.Random, rows: int) -> list[tuple[Any, ...]]:
    """Few keys, few versions (ties), values with nulls, NaN, 0.0 and -0.0."""
    amounts = [None, 0.0, -0.0, 1.5, -2.0, math.nan, math.inf]
    return [(rng.choice(["eu", "us", "é"]), rng.randrange(12), rng.randrange(4),
             rng.choice([None, "a", "b", "B", "é"]), rng.choice(amounts))
            for _ in range(rows)]


def stored(engine: sa.Engine, target: sa.Table) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    def same(value: Any) -> Any:  # NaN != NaN: compare it as a marker
        return "NaN" if isinstance(value, float) and math.isnan(value) else value

    with engine.connect() as conn:
        return {(r.region, r.order_id): (r.version, r.status, same(r.amount))
                for r in conn.execute(sa.select(target))}


@pytest.fixture
def small_arrow_batches(spark: SparkSession) -> Iterator[None]:
    key = "spark.sql.execution.arrow.maxRecordsPerBatch"
    previous = spark.conf.get(key)
    spark.conf.set(key, "7")
    yield
    spark.conf.set(key, str(previous))


@pytest.mark.parametrize("db_url", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
                         indirect=True)
def test_the_sorted_plan_writes_what_the_aggregate_plan_writes(
    spark: SparkSession, db_url: str, engine: sa.Engine, unique: str,
    small_arrow_batches: None,
) -> None:
    plans = {"aggregate": table(f"plain_{unique}"), "sorted": table(f"fast_{unique}")}
    for target in plans.values():
        target.create(engine)
    try:
        for seed, size in enumerate([1, 40, 300]):
            rng = random.Random(seed)
            rows = batch(rng, size)
            df = spark.createDataFrame(rows, SCHEMA).repartition(3)  # any order
            results = {plan: _upsert(df, db_url, target.name, ("region", "order_id"),
                                     "version", rng.choice([1, 5, 1000]), schema=None,
                                     engine_options=None, policy=None, plan=plan)
                       for plan, target in plans.items()}
            assert results["sorted"] == results["aggregate"], seed
            assert results["sorted"].rows == len(rows)
            assert stored(engine, plans["sorted"]) == stored(engine, plans["aggregate"]), seed
    finally:
        for target in plans.values():
            target.drop(engine)


def test_the_sorted_plan_refuses_a_row_without_a_key_or_a_version_as_the_aggregate_did() -> None:
    """The messages of the plain twin (whose own job test is in test_spark_upsert.py),
    from Arrow batches alone."""
    import pyarrow as pa

    latest = LatestRows(("region", "order_id"), "version", "sorted")
    good = [("eu", 1, 2, "b", 1.0), ("eu", 1, 1, "a", 1.0)]
    for bad, error, message in [
        (("eu", 1, None, "c", 1.0), MissingVersion, r"^1 row\(s\) of key \('eu', 1\) have "
                                                    r"no 'version'"),
        ((None, 2, 1, "c", 1.0), MalformedMessage, r"^1 row\(s\) have no 'region/order_id'"),
    ]:
        rows = [dict(zip(COLUMNS, row, strict=True)) for row in (*good, bad)]
        batches = iter([pa.RecordBatch.from_pylist(rows)])
        with pytest.raises(error, match=message):
            list(latest.records(batches, [0], []))


def test_key_runs_cross_arrow_batches_and_nan_keys_are_one_key() -> None:
    """The run detection alone (no Spark): sorted rows in batches of two."""
    import pyarrow as pa

    rows = [(math.nan, 3), (math.nan, 1), (0.0, 5), (-0.0, 2), (1.0, 7), (1.0, 6), (1.0, 1)]
    batches = [pa.RecordBatch.from_pylist([{"k": k, "v": v} for k, v in rows[i:i + 2]])
               for i in range(0, len(rows), 2)]
    tally = [0]
    kept = list(LatestRows(("k",), "v", "sorted").records(iter(batches), tally, []))
    assert tally == [7]
    assert [v for _, v in kept] == [3, 5, 7]  # NaN, 0.0 (= -0.0), 1.0
