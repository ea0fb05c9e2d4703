"""Faults made on the server side for the reliability tests, shared by their files:
``rabbitmqctl`` on our own connections and queues only, the ``quiet`` fixture, the
stop/close race of a consumer and its broker, and a RabbitMQ node of the test's own
(:class:`OwnRabbit`) to SIGKILL and restart."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def quiet() -> Iterator[None]:
    """msgpatterns' own log quiet while faults are made (they log by design)."""
    logger = logging.getLogger("msgpatterns")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


def rabbitmqctl(*args: str) -> str:
    return subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True,
                          timeout=60, check=True).stdout


def close_rabbit_connections(name: str, reason: str = "reliability test: server-side close"
                             ) -> int:
    """``rabbitmqctl close_connection`` of the connections named ``name`` (ours only);
    how many were closed (one gone already does not count)."""
    closed = 0
    for line in rabbitmqctl("list_connections", "pid", "client_properties",
                            "--no-table-headers").splitlines():
        if f'"{name}"' not in line and f'<<"{name}">>' not in line:
            continue
        with contextlib.suppress(subprocess.CalledProcessError):  # gone already
            rabbitmqctl("close_connection", line.split("\t", 1)[0].strip(), reason)
            closed += 1
    return closed


def rabbit_queue_depth(queue: str) -> int:
    """Messages in ``queue``, ready and delivered-unacked (0 when it does not exist)."""
    for line in rabbitmqctl("list_queues", "name", "messages",
                            "--no-table-headers").splitlines():
        name, _, count = line.partition("\t")
        if name == queue:
            return int(count.strip())
    return 0


def race_stop_and_close(driver: Any, broker: Any) -> None:
    """The consumer's ``stop(5)`` and its broker's ``close()`` at the same moment: from
    two threads, or two tasks on the asyncio side (a sync ``close`` runs in a thread)."""
    if driver.is_async:
        async def both() -> None:
            closing = (broker.close() if inspect.iscoroutinefunction(broker.close)
                       else asyncio.to_thread(broker.close))
            await asyncio.gather(driver.consumer.stop(5), closing, return_exceptions=True)
        driver.call(both)
        return
    barrier = threading.Barrier(2)

    def run(fn: Callable[[], Any]) -> None:
        barrier.wait()
        with contextlib.suppress(Exception):
            fn()

    threads = [threading.Thread(target=run, args=(fn,))
               for fn in (lambda: driver.consumer.stop(5), broker.close)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)


# -- a RabbitMQ node of the test's own, killed with SIGKILL and restarted ----------------

RABBIT_BIN = "/usr/lib/rabbitmq/bin"  # the scripts themselves (/usr/sbin's wrappers su)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OwnRabbit:
    """A private ``rabbitmq-server`` node: its own node name, AMQP and distribution
    ports, Mnesia directory, config, cookie and logs under ``root`` (the shared node on
    5672 is never touched). :meth:`kill` SIGKILLs its beam (by the pid the node wrote);
    :meth:`start` again boots it on the same data, so durable queues and persistent,
    confirmed messages survive. A boot takes about 7 s on the CI machine."""

    def __init__(self, root: Path, name: str) -> None:
        if not Path(RABBIT_BIN, "rabbitmq-server").exists():
            pytest.skip("rabbitmq-server not installed")
        self.root, self.port, self.dist_port = root, free_port(), free_port()
        self.node = f"{name}@localhost"
        self.proc: subprocess.Popen[bytes] | None = None
        root.mkdir(parents=True, exist_ok=True)
        (root / "rabbitmq.conf").write_text(
            f"listeners.tcp.local = 127.0.0.1:{self.port}\nloopback_users = none\n")
        (root / "enabled_plugins").write_text("[].\n")
        (root / "rabbitmq-env.conf").write_text("")
        cookie = root / ".erlang.cookie"
        cookie.write_text(uuid.uuid4().hex.upper())
        cookie.chmod(0o400)
        self.env = {**os.environ, "HOME": str(root),
                    "RABBITMQ_NODENAME": self.node,
                    "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
                    "RABBITMQ_NODE_PORT": str(self.port),
                    "RABBITMQ_DIST_PORT": str(self.dist_port),
                    "RABBITMQ_MNESIA_BASE": str(root / "mnesia"),
                    "RABBITMQ_LOG_BASE": str(root / "log"),
                    "RABBITMQ_CONFIG_FILE": str(root / "rabbitmq.conf"),
                    "RABBITMQ_ADVANCED_CONFIG_FILE": str(root / "advanced.config"),
                    "RABBITMQ_CONF_ENV_FILE": str(root / "rabbitmq-env.conf"),
                    "RABBITMQ_ENABLED_PLUGINS_FILE": str(root / "enabled_plugins"),
                    "RABBITMQ_PLUGINS_EXPAND_DIR": str(root / "plugins"),
                    "RABBITMQ_FEATURE_FLAGS_FILE": str(root / "feature_flags"),
                    "RABBITMQ_PID_FILE": str(root / "pid")}

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def start(self, timeout: float = 90.0) -> float:
        """Boot the node and wait until it accepts AMQP connections; the seconds taken."""
        began = time.monotonic()
        (self.root / "pid").unlink(missing_ok=True)
        self.proc = subprocess.Popen([f"{RABBIT_BIN}/rabbitmq-server"], env=self.env,
                                     cwd=self.root, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return time.monotonic() - began
            except OSError:
                if self.proc.poll() is not None or time.monotonic() - began > timeout:
                    self.kill()
                    raise RuntimeError(f"the test's RabbitMQ node did not start; see "
                                       f"{self.root / 'log'}") from None
                time.sleep(0.1)  # waiting for a process we started to listen

    def boot(self) -> None:
        self.start()

    def kill(self) -> None:
        """SIGKILL the node's beam (no shutdown of any kind), then reap the script."""
        pid_file = self.root / "pid"
        if pid_file.exists() and pid_file.read_text().strip():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                if self.proc.poll() is None and not pid_file.exists():
                    self.proc.kill()  # it died before writing its pid: the script
            self.proc.wait(30)
            self.proc = None

    def ctl(self, *args: str) -> str:
        return subprocess.run([f"{RABBIT_BIN}/rabbitmqctl", "-q", "-n", self.node, *args],
                              env=self.env, capture_output=True, text=True, timeout=60,
                              check=True).stdout

    def queue_depth(self, queue: str) -> int:
        """Messages in ``queue`` on this node, ready and delivered-unacked."""
        for line in self.ctl("list_queues", "name", "messages",
                             "--no-table-headers").splitlines():
            name, _, count = line.partition("\t")
            if name == queue:
                return int(count.strip())
        return 0
