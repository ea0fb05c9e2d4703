"""nats-server instances a test starts on a free port and stops by pid (the shared
server on 4222 is never touched)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from broker_harness import require_library
from msgpatterns.testing import services

NATS_SERVER = shutil.which("nats-server") or "/usr/sbin/nats-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(directory: Path, port: int, tls: Any = None,
                 extra: str = "") -> subprocess.Popen[bytes]:
    """A nats-server on 127.0.0.1:``port`` (JetStream; TLS required when ``tls`` - an
    object with ``cert`` and ``key`` paths; ``extra`` configuration lines), started and
    ready; stop it with :func:`stop_server`."""
    require_library("nats", "NatsJetStreamBroker")
    if not Path(NATS_SERVER).exists():
        if services.services_required():
            pytest.fail("nats-server binary not found")
        pytest.skip("nats-server binary not found")
    directory.mkdir(parents=True, exist_ok=True)
    conf = directory / "server.conf"
    text = f'listen: "127.0.0.1:{port}"\njetstream {{ store_dir: "{directory / "js"}" }}\n'
    if tls is not None:
        text += f'tls {{ cert_file: "{tls.cert}", key_file: "{tls.key}", timeout: 5 }}\n'
    conf.write_text(text + extra)
    proc = subprocess.Popen([NATS_SERVER, "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    give_up = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > give_up:
                stop_server(proc)
                raise RuntimeError("the test's nats-server did not start") from None
            time.sleep(0.05)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """Stop a server this test started (by its pid)."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
