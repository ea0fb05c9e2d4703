"""Local Spark servers for tests, demos and benchmarks, started from the pyspark
package alone (no downloads): a standalone master with workers, and a Spark Connect
server. All bind 127.0.0.1 on free ports and are stopped by their own pid (each
``spark-class`` launch ``exec``s java, so the pid started is the JVM's).

Not for production: no authentication, no TLS.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import msgpatterns
from msgpatterns._extras import require

__all__ = ["Cluster", "ConnectServer", "cluster_conf_for", "descendants", "kill_tree",
           "start_cluster", "start_connect_server"]

#: The directory that holds this ``msgpatterns`` package (the Python workers of the
#: servers started here import it from there).
SOURCE_ROOT = str(Path(msgpatterns.__file__).parent.parent)
#: Variables pyspark sets in a process that created a Spark Connect session.
CONNECT_MARKS = ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE", "SPARK_LOCAL_REMOTE")
CONNECT_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def pyspark_home() -> Path:
    """The pyspark package directory: a complete SPARK_HOME (jars, bin, sbin)."""
    pyspark = require("pyspark", "spark")
    return Path(str(pyspark.__file__)).parent


def spark_env(workdir: Path) -> dict[str, str]:
    """The environment of a JVM we start, and of the Python workers it starts."""
    path = os.environ.get("PYTHONPATH", "")
    # a Spark Connect session in this process marks it with these; a classic driver
    # started from here must not inherit them
    inherited = {k: v for k, v in os.environ.items() if k not in CONNECT_MARKS}
    return {
        **inherited,
        "SPARK_HOME": str(pyspark_home()),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOG_DIR": str(workdir),
        "SPARK_PID_DIR": str(workdir),
        "SPARK_IDENT_STRING": f"msgpatterns{os.getpid()}",
        "PYSPARK_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join(p for p in (SOURCE_ROOT, path) if p),
    }


def wait_for_port(port: int, pid: int, log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            raise RuntimeError(f"the server exited; see {log}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"nothing listens on port {port} after {timeout:.0f} s; see {log}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop(pid: int, timeout: float = 30.0) -> None:
    """SIGTERM the process, SIGKILL it if it is still there after ``timeout``."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # not our child (the daemon script started it)
            if not alive(pid):
                return
        time.sleep(0.2)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, their children...), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> list[int]:
    """``kill -9`` of ``pid`` and every process below it (taken before the kill, so
    orphans are not missed); returns the pids signalled."""
    tree = [pid, *descendants(pid)]
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)
    return tree


@dataclass
class ConnectServer:
    """A Spark Connect server on ``local[2,2]``; ``url`` is its ``sc://`` address."""

    port: int
    pid: int
    log: Path

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop(self.pid)


def start_connect_server(workdir: Path, *, fast_start: bool = True) -> ConnectServer:
    """``sbin/start-connect-server.sh`` with SPARK_HOME = the pyspark package;
    ``fast_start`` tunes its JVM for short runs (tests), off for measurements."""
    from msgpatterns.spark.local import FAST_START

    port = free_port()
    env = spark_env(workdir)
    confs = {
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.sql.adaptive.coalescePartitions.enabled": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.driver.memory": "1g",
        "spark.log.level": "WARN",
        **({"spark.driver.extraJavaOptions": FAST_START} if fast_start else {}),
    }
    args = [str(pyspark_home() / "sbin" / "start-connect-server.sh"), "--master", "local[2,2]"]
    for key, value in confs.items():
        args += ["--conf", f"{key}={value}"]
    subprocess.run(args, env=env, check=True, timeout=120, capture_output=True)
    ident = env["SPARK_IDENT_STRING"]
    pid = int((workdir / f"spark-{ident}-{CONNECT_CLASS}-1.pid").read_text())
    log = next(workdir.glob(f"spark-{ident}-{CONNECT_CLASS}-1-*.out"))
    server = ConnectServer(port, pid, log)
    try:
        wait_for_port(port, pid, log)
    except BaseException:
        server.stop()
        raise
    return server


@dataclass
class Cluster:
    """A standalone master and its workers (1 core, 1 GB each)."""

    port: int
    ui_port: int
    master: subprocess.Popen[bytes]
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def alive_workers(self) -> int:
        """Workers the master counts alive (0 while its UI does not answer)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/",
                                        timeout=30) as reply:
                state = json.load(reply)
        except (OSError, ValueError):  # not up yet, or not ALIVE yet (no JSON)
            return 0
        return int(state.get("aliveworkers", 0))

    def stop(self) -> None:
        for process in [*self.workers, self.master]:
            stop(process.pid)


def start_cluster(workdir: Path, workers: int = 2) -> Cluster:
    """``bin/spark-class`` Master and Worker processes on 127.0.0.1."""
    # no REST submission server: it would take the fixed port 6066
    env = {**spark_env(workdir), "SPARK_MASTER_OPTS": "-Dspark.master.rest.enabled=false"}
    spark_class = str(pyspark_home() / "bin" / "spark-class")
    port, ui_port = free_port(), free_port()
    with open(workdir / "master.log", "wb") as log:
        master = subprocess.Popen(
            [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
             "--port", str(port), "--webui-port", str(ui_port)],
            env=env, stdout=log, stderr=subprocess.STDOUT)
    cluster = Cluster(port, ui_port, master)
    try:
        wait_for_port(port, master.pid, workdir / "master.log")
        wait_for_port(ui_port, master.pid, workdir / "master.log")
        for n in range(workers):
            work = workdir / f"worker-{n}"
            work.mkdir()
            with open(workdir / f"worker-{n}.log", "wb") as log:
                cluster.workers.append(subprocess.Popen(
                    [spark_class, "org.apache.spark.deploy.worker.Worker", cluster.url,
                     "--host", "127.0.0.1", "--cores", "1", "--memory", "1g",
                     "--webui-port", str(free_port()), "--work-dir", str(work)],
                    env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 180
        while cluster.alive_workers() < workers:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{workers} workers did not register; see {workdir}")
            time.sleep(0.5)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def cluster_conf_for(master: str, *, fast_start: bool = True) -> dict[str, str]:
    """Settings of a driver session on a standalone cluster (its executors run this
    Python and import this ``msgpatterns``); ``fast_start`` tunes the executors' JVMs
    for short runs, as :func:`~msgpatterns.spark.local.local_spark` does the driver's."""
    from msgpatterns.spark.local import FAST_START

    return {
        **({"spark.executor.extraJavaOptions": FAST_START} if fast_start else {}),
        "spark.pyspark.python": sys.executable,
        "spark.executorEnv.PYTHONPATH": spark_env(Path("."))["PYTHONPATH"],
        "spark.executor.memory": "512m",
        "spark.cores.max": "2",
        "spark.task.maxFailures": "4",
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
    }
