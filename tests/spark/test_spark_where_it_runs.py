"""The sinks from the same code on a classic local session, a standalone cluster (a
master and two 1-core workers) and Spark Connect: every table exact after resends, a
replayed batch, and - on the cluster and on Connect - the driver killed mid-batch
(and on the cluster an executor too)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
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


def scenario(target: str, workdir: Path, url: str, phase: str,
             *options: str) -> subprocess.Popen[str]:
    """The scenario's driver (a classic driver on a cluster, or a Connect client) as a
    child process, cut at ``phase``; its output goes to files in ``workdir``."""
    from msgpatterns.spark.servers import spark_env

    name = phase.replace(":", "-")
    with open(workdir / f"{name}.out", "w") as out, open(workdir / f"{name}.err", "w") as err:
        return subprocess.Popen(
            [sys.executable, str(Path(sink_scenario.__file__)), target, str(workdir), url,
             phase, *options], stdout=out, stderr=err, text=True, env=spark_env(workdir))


def wait_for(done: Callable[[], bool], process: subprocess.Popen[str], workdir: Path,
             phase: str, what: str, timeout: float = 600) -> None:
    """Poll ``done`` (a file the child writes) while the child runs."""
    deadline = time.monotonic() + timeout
    while not done():
        if process.poll() is not None:
            raise AssertionError(f"phase {phase} ended before {what}: " + errors(workdir, phase))
        assert time.monotonic() < deadline, f"phase {phase}: no {what} after {timeout:.0f} s"
        time.sleep(0.1)


def errors(workdir: Path, phase: str) -> str:
    return (workdir / f"{phase.replace(':', '-')}.err").read_text()[-4000:]


def paused(process: subprocess.Popen[str], workdir: Path, phase: str) -> int:
    """Wait until the batch function pauses at ``phase``; the pid of the process that
    paused (the driver, or the Connect server's Python worker)."""
    mark = workdir / f"paused-{phase.replace(':', '-')}"
    wait_for(lambda: mark.exists() and bool(mark.read_text()), process, workdir, phase,
             "its pause")
    return int(mark.read_text())


def finished(process: subprocess.Popen[str], workdir: Path, phase: str) -> list[Any]:
    """The JSON lines the phase printed."""
    assert process.wait(timeout=900) == 0, errors(workdir, phase)
    out = (workdir / f"{phase}.out").read_text()
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def wait_for_held(marks: Path, process: subprocess.Popen[str],
                  workdir: Path) -> list[set[int]]:
    """Wait until both executors hold a write task; the pids above each held task."""
    def held() -> list[Path]:
        return [p for p in marks.glob("held-*") if p.read_text()]

    wait_for(lambda: len(held()) >= 2, process, workdir, "finish", "two held write tasks")
    return [{int(pid) for pid in p.read_text().split()} for p in held()]


def stopped(process: subprocess.Popen[str]) -> None:
    """Make sure a child this test started is gone (by its pid, with what it started)."""
    from msgpatterns.spark.servers import kill_tree

    if process.poll() is None:
        kill_tree(process.pid)
    process.wait(timeout=60)


@pytest.mark.timeout(1800)
def test_a_driver_and_an_executor_killed_mid_batch_on_a_standalone_cluster(
    spark_cluster: Any, tmp_path: Path,
) -> None:
    """Issue 20 on a standalone cluster (a master and two 1-core workers).

    1. ``kill -9`` of the driver (its Python process and its JVM) in the middle of the
       batch function, after append_rows committed the batch's partitions and before
       dedup_rows marked its keys DONE and the ledger recorded the batch. A new driver
       restarts from the same checkpoint (Spark re-runs the batch), then a replay after
       deleting ``commits/N``, then resends of the killed batch's events: every row
       once, every batch once in both ledgers, every key DONE.
    2. In the same driver, ``kill -9`` of an executor JVM while two partitions of an
       append are committed and two are in flight: Spark re-runs the lost task and
       recomputes the cached claims that died with the executor (same owner, so they
       come back ``CLAIMED``); 800 of 800 rows, each once, and a resend of them all is
       dropped.
    """
    from msgpatterns.spark.servers import kill_tree

    url = f"sqlite:///{tmp_path / 'sink.db'}"
    phase = sink_scenario.KILL_POINTS[0]
    driver = scenario(spark_cluster.url, tmp_path, url, phase)
    try:
        assert paused(driver, tmp_path, phase) == driver.pid
        killed = kill_tree(driver.pid)  # the Python driver and its JVM
        assert len(killed) >= 2, killed
    finally:
        stopped(driver)

    driver = scenario(spark_cluster.url, tmp_path, url, "finish", "--executor-loss", "800")
    marks = tmp_path / "executor-loss"
    try:
        held = wait_for_held(marks, driver, tmp_path)
        executor = next(pid for pid in executor_pids(spark_cluster) if pid in held[0])
        os.kill(executor, signal.SIGKILL)  # it holds a write task, and its claims' cache
        (marks / "release").touch()
        scenario_state, loss = finished(driver, tmp_path, "finish")
    finally:
        stopped(driver)
    assert scenario_state == EXPECTED
    starts = sorted(p.name for p in marks.glob("start-*"))
    print("after kill -9 of an executor:", loss, "write tasks run:", starts)
    assert len(starts) > 8, "no write task ran again after the executor was lost"
    assert (loss["rows"], loss["distinct"], loss["ledgered"]) == (800, 800, 800)
    # the call's own count is exact too: one call wrote every partition, whichever of its
    # task attempts committed
    assert (loss["appended"], loss["skipped_partitions"]) == (800, 0)
    assert (loss["resent_kept"], loss["resent_dropped"]) == (0, 800)


@pytest.mark.timeout(1800)
def test_a_connect_server_killed_mid_batch(connect_server: Any, tmp_path: Path) -> None:
    """Issue 20 on Spark Connect, where the driver is the server: ``kill -9`` of a
    server's JVM and its Python workers (the batch function runs in one of them) in
    the middle of batch 2, after its keys were claimed and before anything was
    written (the cluster test kills at the other point); the restart and the rest on
    the run's shared server. The same exact tables and ledgers as everywhere."""
    from msgpatterns.spark.servers import kill_tree, start_connect_server

    url = f"sqlite:///{tmp_path / 'sink.db'}"
    phase = sink_scenario.KILL_POINTS[1]
    (tmp_path / "server").mkdir()
    server = start_connect_server(tmp_path / "server")
    try:
        client = scenario(server.url, tmp_path, url, phase)
        try:
            worker = paused(client, tmp_path, phase)
        finally:
            killed = kill_tree(server.pid)
            stopped(client)  # it fails once its server is gone
    finally:
        server.stop()
    assert worker in killed, (worker, killed)
    client = scenario(connect_server.url, tmp_path, url, "finish")
    try:
        assert finished(client, tmp_path, "finish") == [EXPECTED]
    finally:
        stopped(client)


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
