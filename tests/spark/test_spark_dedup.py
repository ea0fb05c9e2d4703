"""dedup_rows: resent events are written once; a failed write gives its keys back."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa
from spark_streams import (
    EVENT_SCHEMA,
    AppendRows,
    FileStream,
    appended,
    event,
    events_table,
)

from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency import (
    CheckerSpec,
    MemoryChecker,
    SqlChecker,
    TransactionalSqlChecker,
    checker_from_spec,
)
from msgpatterns.spark import DedupStats, dedup_rows
from msgpatterns.testing import services

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

pytestmark = pytest.mark.spark


@pytest.fixture(params=["sql", pytest.param("redis", marks=pytest.mark.redis)])
def checker_spec(request: pytest.FixtureRequest, tmp_path: Path,
                 unique: str) -> Iterator[CheckerSpec]:
    """A SqlChecker on a SQLite file, or a RedisChecker on the real Redis."""
    if request.param == "sql":
        spec = CheckerSpec("sql", f"sqlite:///{tmp_path / 'dedup.db'}", {"lease": 30})
    else:
        spec = CheckerSpec("redis", services.require("redis"),
                           {"namespace": f"spark-{unique}", "lease": 30})
    yield spec
    if request.param == "redis":
        import redis

        client = redis.Redis.from_url(spec.url)
        for name in client.scan_iter(f"spark-{unique}:*"):
            client.delete(name)
        client.close()


def test_resent_events_are_written_once(
    stream: FileStream, sqlite_url: str, checker_spec: CheckerSpec, unique: str,
) -> None:
    engine = sa.create_engine(sqlite_url)
    events = events_table(f"events_{unique}")
    events.create(engine)
    stats: list[DedupStats] = []

    def write(df: DataFrame, batch_id: int) -> None:
        with dedup_rows(df, checker_spec, key="event_id", group="orders") as fresh:
            stats.append(fresh.stats)
            fresh.df.select("event_id", "order_id", "version").foreachPartition(
                AppendRows(sqlite_url, events.name))

    stream.add(event("o1", 1), event("o2", 1), event("o2", 1))   # a duplicate in the batch
    stream.add(event("o2", 1), event("o1", 2))                   # o2 v1 resent
    stream.add(event("o1", 1), event("o1", 2), event("o3", 1))   # two resent
    stream.run(write)
    assert appended(engine, events) == [("o1:v1", 1), ("o1:v2", 2), ("o2:v1", 1),
                                        ("o3:v1", 1)]
    assert stats == [DedupStats(kept=2, dropped=0, in_progress=0),
                     DedupStats(kept=1, dropped=1, in_progress=0),
                     DedupStats(kept=1, dropped=2, in_progress=0)]
    engine.dispose()


def test_a_failed_write_releases_its_keys_and_a_held_key_is_kept(
    spark: SparkSession, checker_spec: CheckerSpec,
) -> None:
    df = spark.createDataFrame([event(f"o{n}", 1) for n in range(6)], EVENT_SCHEMA)

    def failing_write() -> None:
        with dedup_rows(df, checker_spec, key="event_id") as fresh:
            assert fresh.df.count() == 6
            raise RuntimeError("the sink is down")

    with pytest.raises(RuntimeError, match="the sink is down"):
        failing_write()

    elsewhere = checker_from_spec(checker_spec)  # say, a consumer working on o5 right now
    held = elsewhere.claim("o5:v1")
    assert held.claimed

    fresh = dedup_rows(df, checker_spec, key="event_id")
    assert fresh.stats == DedupStats(kept=6, dropped=0, in_progress=1)  # released, and kept
    assert sorted(r.event_id for r in fresh.df.collect()) == [f"o{n}:v1" for n in range(6)]
    assert fresh.commit() == 5  # o5 is the other owner's to complete
    with pytest.raises(ConfigurationError, match="already"):
        fresh.commit()

    assert elsewhere.complete(held)
    elsewhere.close()
    again = dedup_rows(df, checker_spec, key="event_id")
    assert again.stats == DedupStats(kept=0, dropped=6, in_progress=0)
    assert again.df.count() == 0
    again.release()


def test_only_shared_checkers_and_existing_columns(spark: SparkSession, tmp_path: Path) -> None:
    df = spark.createDataFrame([event("o1", 1)], EVENT_SCHEMA)
    url = f"sqlite:///{tmp_path / 'dedup.db'}"
    with pytest.raises(ConfigurationError, match="Redis"):
        dedup_rows(df, MemoryChecker(), key="event_id")
    with pytest.raises(ConfigurationError, match="Redis or SQL"):
        dedup_rows(df, TransactionalSqlChecker(url), key="event_id")
    with pytest.raises(ConfigurationError, match="no column"):
        dedup_rows(df, SqlChecker(url), key="missing")


def test_a_recomputed_claim_gets_the_same_claims_back(
    spark: SparkSession, checker_spec: CheckerSpec,
) -> None:
    """Issue 20, 1: the claimed rows' blocks are lost (an executor died); the write and
    the commit recompute the claims, which must find the keys still theirs."""
    df = spark.createDataFrame([event(f"o{n}", 1) for n in range(6)], EVENT_SCHEMA)
    ids = [f"o{n}:v1" for n in range(6)]
    fresh = dedup_rows(df, checker_spec, key="event_id")
    assert fresh.stats == DedupStats(kept=6, dropped=0, in_progress=0)
    spark.catalog.clearCache()  # the cached claims are gone, as with a lost executor
    assert sorted(r.event_id for r in fresh.df.collect()) == ids  # the write recomputes
    assert fresh.commit() == 6  # and so does the commit: every key is marked DONE

    resent = dedup_rows(df, checker_spec, key="event_id")
    assert resent.stats == DedupStats(kept=0, dropped=6, in_progress=0)
    assert resent.df.count() == 0
    resent.release()


def test_a_replayed_batch_gets_its_claims_back(
    spark: SparkSession, checker_spec: CheckerSpec,
) -> None:
    """The driver died between the claims and ``commit`` (nothing released them); Spark
    re-runs the batch with the same id. With ``sink_id``/``batch_id`` the re-run owns
    the claims and marks them DONE; with a fresh owner per call (the contrast) it finds
    them in progress and marks none, so a later resend would be written again."""
    df = spark.createDataFrame([event(f"o{n}", 1) for n in range(6)], EVENT_SCHEMA)
    batch = {"sink_id": "payments", "batch_id": 7, "query_id": "q1"}
    dedup_rows(df, checker_spec, key="event_id", **batch)  # claimed, then the crash
    replay = dedup_rows(df, checker_spec, key="event_id", **batch)
    assert replay.stats == DedupStats(kept=6, dropped=0, in_progress=0)
    assert replay.commit() == 6
    resent = dedup_rows(df, checker_spec, key="event_id")
    assert resent.stats == DedupStats(kept=0, dropped=6, in_progress=0)
    resent.release()

    other = spark.createDataFrame([event(f"p{n}", 1) for n in range(6)], EVENT_SCHEMA)
    dedup_rows(other, checker_spec, key="event_id")  # claimed by a fresh owner, then the crash
    rerun = dedup_rows(other, checker_spec, key="event_id")
    assert rerun.stats == DedupStats(kept=6, dropped=0, in_progress=6)
    assert rerun.commit() == 0

    # another batch, query or sink is another owner
    for change in ({"batch_id": 8}, {"query_id": "q2"}, {"sink_id": "refunds"}):
        again = dedup_rows(other, checker_spec, key="event_id", **{**batch, **change})
        assert again.stats.in_progress == 6, change
        again.release()


def test_batch_claims_need_a_sink_and_a_batch(spark: SparkSession, tmp_path: Path) -> None:
    df = spark.createDataFrame([event("o1", 1)], EVENT_SCHEMA)
    url = f"sqlite:///{tmp_path / 'dedup.db'}"
    with pytest.raises(ConfigurationError, match="sink_id"):
        dedup_rows(df, url, key="event_id", batch_id=1)
    with pytest.raises(ConfigurationError, match="need batch_id"):
        dedup_rows(df, url, key="event_id", sink_id="s")
    with pytest.raises(ConfigurationError, match="batch_id must"):
        dedup_rows(df, url, key="event_id", sink_id="s", batch_id=-1)
    with pytest.raises(ConfigurationError, match="foreachBatch"):
        dedup_rows(df, url, key="event_id", sink_id="s", batch_id=1)  # no query id here
