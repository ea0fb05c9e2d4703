"""The sinks from the same code on a classic local session, a standalone cluster (a
master and two 1-core workers) and Spark Connect: every table exact after resends and
a replayed batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import sink_scenario
from sink_scenario import EXPECTED

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark


@pytest.fixture(autouse=True)
def _ship_the_scenario_by_value() -> None:
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sink_scenario)  # type: ignore[no-untyped-call]


def test_on_a_classic_local_session(spark: SparkSession, tmp_path: Path) -> None:
    assert sink_scenario.run(spark, tmp_path, f"sqlite:///{tmp_path / 'sink.db'}") == EXPECTED


def test_on_spark_connect(connect_spark: SparkSession, tmp_path: Path) -> None:
    assert sink_scenario.run(connect_spark, tmp_path,
                             f"sqlite:///{tmp_path / 'sink.db'}") == EXPECTED


def test_on_a_standalone_cluster(spark_cluster: Any, tmp_path: Path) -> None:
    from msgpatterns.spark.servers import spark_env

    result = subprocess.run(
        [sys.executable, str(Path(sink_scenario.__file__)), spark_cluster.url, str(tmp_path),
         f"sqlite:///{tmp_path / 'sink.db'}"],
        capture_output=True, text=True, timeout=600, env=spark_env(tmp_path))
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == EXPECTED


def test_what_connect_cannot_know_is_a_configuration_error(connect_spark: SparkSession) -> None:
    from msgpatterns.errors import ConfigurationError
    from msgpatterns.spark import streaming_query_id

    with pytest.raises(ConfigurationError, match=r"checkpoint=.*scope=.sink."):
        streaming_query_id(connect_spark.range(1))


def executor_pids(cluster: Any) -> list[int]:
    """The executor JVMs: children of the workers this run started."""
    found = []
    for worker in cluster.workers:
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(worker.pid)],
                                  capture_output=True, text=True).stdout.split()
        for pid in children:
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"CoarseGrainedExecutorBackend" in command:
                found.append(int(pid))
    return found


def test_an_executor_killed_mid_batch_loses_and_doubles_nothing(
    spark_cluster: Any, tmp_path: Path,
) -> None:
    """Issue 20, 1 and 2 where they happen: ``kill -9`` of an executor JVM while
    append_rows writes the rows dedup_rows claimed. Spark re-runs the lost tasks (and
    recomputes the lost cached claims): every row once, every key marked DONE."""
    import os
    import signal
    import time

    import sqlalchemy as sa

    from msgpatterns.spark.servers import spark_env

    url = f"sqlite:///{tmp_path / 'loss.db'}"
    engine = sa.create_engine(url)
    sa.Table("loss_payments", sa.MetaData(), sa.Column("event_id", sa.String(40)),
             sa.Column("order_id", sa.String(40)), sa.Column("version", sa.BigInteger)
             ).create(engine)
    driver = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "executor_loss.py"), spark_cluster.url,
         url, "4000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=spark_env(tmp_path))
    killed: list[int] = []
    seen: list[tuple[int, int]] = []
    deadline = time.monotonic() + 300
    while not killed and driver.poll() is None and time.monotonic() < deadline:
        try:
            with engine.connect() as conn:
                committed = conn.execute(sa.text("SELECT count(*) FROM loss_partitions")).scalar()
        except sa.exc.OperationalError:  # not created yet
            committed = 0
        pids = executor_pids(spark_cluster)
        seen.append((committed or 0, len(pids)))
        if committed and committed >= 2 and pids:
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])
        time.sleep(0.2)
    out, err = driver.communicate(timeout=600)
    engine.dispose()
    assert driver.returncode == 0, err[-4000:]
    assert killed, f"the batch ended before an executor could be killed: {seen[-20:]}"
    state = json.loads(out.strip().splitlines()[-1])
    print("after kill -9 of an executor:", state)
    assert (state["rows"], state["distinct"]) == (4000, 4000)
    assert (state["resent_kept"], state["resent_dropped"]) == (0, 4000)
