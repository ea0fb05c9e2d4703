"""NatsJetStreamBroker's connect, from the outside: a refused port, a server that
accepts and never answers, and the CLI on a dead URL. Each ends with one
BrokerUnavailable naming the cause, within ``connect_timeout`` (plus a little for a
loaded machine; the old code took ``connect_timeout`` + 5 s and said ``TimeoutError()``),
one line on stderr, no leaked task or thread."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker_harness import require_library
from msgpatterns.errors import BrokerUnavailable
from nats_servers import free_port, start_server, stop_server

pytestmark = [pytest.mark.nats, pytest.mark.timeout(60)]

#: Seconds of slack over connect_timeout for a loaded machine (the old code's
#: overshoot was 5 s).
SLACK = 3.0


@pytest.fixture(autouse=True)
def _nats_py() -> None:
    require_library("nats", "NatsJetStreamBroker")


def refused_port() -> int:
    """A local port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A listener that accepts connections and never sends a byte (no INFO)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield int(server.getsockname()[1])
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    server.close()


def _io_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.endswith("-io")}


def test_a_refused_port_raises_broker_unavailable_within_connect_timeout() -> None:
    from msgpatterns.brokers import NatsJetStreamBroker

    before = _io_threads()
    url = f"nats://user:s3cret@127.0.0.1:{refused_port()}"
    started = time.monotonic()
    with pytest.raises(BrokerUnavailable) as caught:
        NatsJetStreamBroker(url, connect_timeout=1.0)
    elapsed = time.monotonic() - started
    text = str(caught.value)
    assert "ConnectionRefused" in text and "within 1 s" in text, text
    assert "s3cret" not in text and "user:***@" in text
    assert elapsed < 1.0 + SLACK, elapsed
    assert _io_threads() == before  # the I/O thread ended with the failed connect


def test_a_server_that_never_answers_raises_within_connect_timeout(
        silent_server: int) -> None:
    from msgpatterns.brokers import NatsJetStreamBroker

    started = time.monotonic()
    with pytest.raises(BrokerUnavailable, match=f"127.0.0.1:{silent_server}"):
        NatsJetStreamBroker(f"nats://127.0.0.1:{silent_server}", connect_timeout=1.0)
    assert time.monotonic() - started < 1.0 + SLACK


def test_a_failed_connect_prints_nothing_and_leaks_no_task() -> None:
    """Before: one stderr warning per retry and "Task was destroyed but it is
    pending!" for the abandoned connect task."""
    code = textwrap.dedent(f"""
        import gc, sys
        from msgpatterns.brokers import NatsJetStreamBroker
        from msgpatterns.errors import BrokerUnavailable
        try:
            NatsJetStreamBroker("nats://127.0.0.1:{refused_port()}", connect_timeout=1.5)
        except BrokerUnavailable as exc:
            print("unavailable:", exc, file=sys.stderr)
        gc.collect()
    """)
    done = subprocess.run([sys.executable, "-X", "dev", "-c", code], capture_output=True,
                          text=True, timeout=30)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unavailable:"), done.stderr
    assert "Task was destroyed" not in done.stderr


def test_the_dlq_cli_on_a_dead_nats_url_is_one_line_within_its_timeout() -> None:
    from msgpatterns.cli._options import CONNECT_TIMEOUT

    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "msgpatterns", "dlq", "list",
         f"nats://u:s3cret@127.0.0.1:{refused_port()}", "--topic", "orders"],
        capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - started
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "ConnectionRefused" in lines[0], done.stderr
    assert "s3cret" not in done.stderr and "Task was destroyed" not in done.stderr
    assert elapsed < CONNECT_TIMEOUT + SLACK + 2.0, elapsed  # + interpreter start-up


def test_refused_credentials_fail_at_once_without_showing_them(tmp_path: Path) -> None:
    """An authorization violation is not transient: it ends the connect at once
    (before: retried until connect_timeout), named, password redacted."""
    from msgpatterns.brokers import NatsJetStreamBroker

    port = free_port()
    server = start_server(tmp_path, port,
                          extra='authorization { user: alice, password: "right-one" }\n')
    try:
        started = time.monotonic()
        with pytest.raises(BrokerUnavailable, match="Authorization Violation") as caught:
            NatsJetStreamBroker(f"nats://alice:wrong-s3cret@127.0.0.1:{port}",
                                connect_timeout=30)
        assert time.monotonic() - started < 15  # not retried until the timeout
        assert "wrong-s3cret" not in str(caught.value)
        with NatsJetStreamBroker(f"nats://alice:right-one@127.0.0.1:{port}") as broker:
            assert "right-one" not in repr(broker)
    finally:
        stop_server(server)
