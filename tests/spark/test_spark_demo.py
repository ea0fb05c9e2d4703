"""``msgpatterns demo --spark``: exact final state through resends, reordering, malformed
lines and a driver crash before Spark's commit."""

from __future__ import annotations

import argparse
import json
import random
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa

from msgpatterns.demo.spark import check, plan_feed, run_spark_demo

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def demo_args(**overrides: Any) -> argparse.Namespace:
    options: dict[str, Any] = {
        "orders": 60, "malformed": 2, "duplicate_rate": 0.2, "reorder_window": 16,
        "lost_ack_rate": 0.5, "seed": 3, "workers": 2, "db": None, "no_progress": True, "files": 4,
    }
    return argparse.Namespace(**{**options, **overrides})


@pytest.mark.spark
@pytest.mark.parametrize("db", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_the_spark_demo_ends_exact(spark: SparkSession, db: str, request: pytest.FixtureRequest,
                                   unique: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = None if db == "sqlite" else request.getfixturevalue("postgres_url")
    prefix = f"spark_demo_{unique}_"
    assert run_spark_demo(demo_args(db=url, table_prefix=prefix))
    out = capsys.readouterr().out
    assert "Final state exact" in out
    assert "replayed batches skipped (ledger)" in out
    assert spark.sparkContext._jsc is not None, "the demo stopped the shared session"
    if url is not None:
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            for table in ("orders", "payments", "dead_letters", "batches", "dedup",
                          "partitions"):
                conn.execute(sa.text(f'DROP TABLE IF EXISTS "{prefix}{table}"'))
        engine.dispose()


def test_the_feed_has_resends_reordering_and_malformed_lines() -> None:
    feed = plan_feed(50, 3, 0.3, 8, random.Random(1))
    lines = [line for file in feed.files for line in file]
    assert len(lines) == feed.events + feed.resent + feed.malformed
    assert feed.resent > 0
    assert sum("broken" in line for line in lines) == 3
    first_seen: dict[str, int] = {}
    for position, line in enumerate(lines):
        if "broken" not in line:
            first_seen.setdefault(json.loads(line)["event_id"], position)
    early = [e for e in first_seen if e.endswith(":v2")
             and first_seen[e] < first_seen[e.replace(":v2", ":v1")]]
    assert early, "no order's v2 comes before its v1"


def test_the_final_check_catches_a_double_payment_and_a_wrong_state() -> None:
    expected = {"orders": {"o1": ("paid", 2)}, "payments": {"o1": 500}}
    actual = {"orders": {"o1": ("created", 1)}, "payments": {"o1": [500, 500]},
              "dead_letters": 1}
    problems = check(expected, actual, malformed=0)
    assert any("wrong state" in p for p in problems)
    assert any("paid more than once" in p for p in problems)
    assert any("dead letter" in p for p in problems)
