"""NATS over TLS, against a nats-server this test starts on a free port with throw-away
certificates (made with ``openssl``) and stops by pid: ``tls://`` means TLS or a clear
error, never plaintext; a CA file or an ``ssl.SSLContext`` is honoured on the sync and
async faces and in the CLI; a failed verification names the SSL problem.

The plaintext case goes through a small TCP proxy that records what the client sends:
nats-py alone answers a server that does not ask for TLS with a plaintext CONNECT that
carries the credentials (an active attacker strips TLS by editing the INFO line)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from broker_harness import require_library
from msgpatterns.errors import BrokerError, BrokerUnavailable, ConfigurationError
from msgpatterns.testing import services
from nats_servers import free_port, start_server, stop_server

pytestmark = [pytest.mark.nats, pytest.mark.timeout(90)]

SECRET = "pw-" + uuid.uuid4().hex[:12]


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@dataclass
class Certs:
    ca: Path
    other_ca: Path
    cert: Path
    key: Path


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """A CA, a server certificate it signed for 127.0.0.1 and localhost, and an
    unrelated CA (to fail verification with)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    d = tmp_path_factory.mktemp("nats-tls")
    for name in ("ca", "other"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
                "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN=msgpatterns test {name}",
                cwd=d)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
            "server.csr", "-subj", "/CN=localhost", cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf",
            cwd=d)
    return Certs(d / "ca.pem", d / "other.pem", d / "server.pem", d / "server.key")


@pytest.fixture(scope="module")
def tls_server(certs: Certs, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A JetStream nats-server requiring TLS on a free port; its port."""
    port = free_port()
    proc = start_server(tmp_path_factory.mktemp("nats-tls-server"), port, certs)
    try:
        yield port
    finally:
        stop_server(proc)


class RecordingProxy:
    """Forwards 127.0.0.1:<port> to ``target`` and records what clients send."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.sent = bytearray()
        self.connections = 0
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self._server.settimeout(0.1)
        while not self._stop.is_set():
            try:
                client, _ = self._server.accept()
            except OSError:
                continue
            self.connections += 1
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:  # the server is down: the client sees a closed connection
                client.close()
                continue
            upstream.settimeout(None)
            self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False),
                             daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._server.close()
        for s in self._socks:
            s.close()


@pytest.fixture
def plaintext_proxy() -> Iterator[RecordingProxy]:
    """A recording proxy in front of the shared (plaintext) NATS server."""
    require_library("nats", "NatsJetStreamBroker")
    url = services.require("nats")
    host_port = url.split("://", 1)[1].split("@")[-1]
    host, port = host_port.rsplit(":", 1)
    proxy = RecordingProxy((host, int(port)))
    yield proxy
    proxy.close()


def test_tls_url_refuses_a_server_that_does_not_ask_for_tls(
        plaintext_proxy: RecordingProxy) -> None:
    """Before: nats-py connected in plaintext and sent CONNECT with the password."""
    from msgpatterns.brokers import NatsJetStreamBroker

    url = f"tls://alice:{SECRET}@127.0.0.1:{plaintext_proxy.port}"
    with pytest.raises(BrokerUnavailable) as caught:
        NatsJetStreamBroker(url, connect_timeout=5)
    text = str(caught.value)
    assert "TLS" in text and "plaintext" in text and SECRET not in text, text
    assert b"CONNECT" not in plaintext_proxy.sent
    assert SECRET.encode() not in plaintext_proxy.sent


def test_tls_with_the_ca_file_connects_and_works(tls_server: int, certs: Certs) -> None:
    from msgpatterns.brokers import NatsJetStreamBroker

    topic = f"tls-{uuid.uuid4().hex[:8]}"
    with NatsJetStreamBroker(f"tls://127.0.0.1:{tls_server}", tls_ca_file=str(certs.ca),
                             connect_timeout=10) as broker:
        broker.publish(topic, b"over tls")
        got = broker.fetch(topic, "g", max_messages=1, timeout=5)
        assert [m.raw_body for m in got] == [b"over tls"]
        broker.ack(got[0])


@pytest.mark.parametrize("scheme", ["tls", "nats"])
def test_an_ssl_context_is_honoured_on_both_schemes(tls_server: int, certs: Certs,
                                                    scheme: str) -> None:
    """``nats://`` with a TLS context means TLS too (the context is the intent), on the
    sync adapter, its threaded async face and the native async adapter."""
    from msgpatterns.aio import ThreadedAsyncBroker
    from msgpatterns.brokers import NatsJetStreamBroker

    context = ssl.create_default_context(cafile=str(certs.ca))
    broker = NatsJetStreamBroker(f"{scheme}://127.0.0.1:{tls_server}", tls_context=context,
                                 connect_timeout=10)
    face = ThreadedAsyncBroker(broker)
    assert not face.closed
    broker.close()
    topic = f"tls-{uuid.uuid4().hex[:8]}"
    assert use_async(f"{scheme}://127.0.0.1:{tls_server}", topic=topic,
                     tls_context=context, connect_timeout=10) == [b"over tls"]


def test_a_failed_verification_names_the_ssl_problem_at_once(tls_server: int,
                                                             certs: Certs) -> None:
    """Before: ``TimeoutError()`` after connect_timeout + 5 s."""
    from msgpatterns.brokers import NatsJetStreamBroker

    for options in ({}, {"tls_ca_file": str(certs.other_ca)}):
        started = time.monotonic()
        with pytest.raises(BrokerUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            NatsJetStreamBroker(f"tls://127.0.0.1:{tls_server}", connect_timeout=30,
                                **options)
        assert time.monotonic() - started < 15  # not retried until the timeout


def test_tls_options_are_checked(certs: Certs, tmp_path: Path) -> None:
    require_library("nats", "NatsJetStreamBroker")
    from msgpatterns.brokers import NatsJetStreamBroker

    with pytest.raises(ConfigurationError, match="not both"):
        NatsJetStreamBroker("tls://127.0.0.1:1", tls_ca_file=str(certs.ca),
                            tls_context=ssl.create_default_context())
    with pytest.raises(ConfigurationError, match="CA file"):
        NatsJetStreamBroker("tls://127.0.0.1:1", tls_ca_file=str(tmp_path / "missing.pem"))


# -- the native asyncio adapter: the same guarantees --------------------------------------


def use_async(url: str, *, topic: str | None = None, **options: object) -> list[bytes]:
    """Connect an AsyncNatsJetStreamBroker to ``url``; with ``topic``, publish, fetch
    and ack one message over it (its body returned); close."""
    from msgpatterns.aio import AsyncNatsJetStreamBroker

    async def use() -> list[bytes]:
        broker = AsyncNatsJetStreamBroker(url, **options)  # type: ignore[arg-type]
        try:
            await broker.connect()
            if topic is None:
                return []
            await broker.publish(topic, b"over tls")
            got = await broker.fetch(topic, "g", max_messages=1, timeout=5)
            for message in got:
                await broker.ack(message)
            return [m.raw_body for m in got]
        finally:
            await broker.close()

    return asyncio.run(use())


def test_async_tls_url_refuses_a_server_that_does_not_ask_for_tls(
        plaintext_proxy: RecordingProxy) -> None:
    url = f"tls://alice:{SECRET}@127.0.0.1:{plaintext_proxy.port}"
    with pytest.raises(BrokerUnavailable) as caught:
        use_async(url, connect_timeout=5)
    text = str(caught.value)
    assert "TLS" in text and "plaintext" in text and SECRET not in text, text
    assert b"CONNECT" not in plaintext_proxy.sent
    assert SECRET.encode() not in plaintext_proxy.sent


def test_async_tls_with_the_ca_file_connects_and_works(tls_server: int,
                                                       certs: Certs) -> None:
    topic = f"tls-{uuid.uuid4().hex[:8]}"
    assert use_async(f"tls://127.0.0.1:{tls_server}", topic=topic,
                     tls_ca_file=str(certs.ca), connect_timeout=10) == [b"over tls"]


def test_async_failed_verification_names_the_ssl_problem_at_once(tls_server: int,
                                                                 certs: Certs) -> None:
    for options in ({}, {"tls_ca_file": str(certs.other_ca)}):
        started = time.monotonic()
        with pytest.raises(BrokerUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            use_async(f"tls://127.0.0.1:{tls_server}", connect_timeout=30, **options)
        assert time.monotonic() - started < 15  # not retried until the timeout


def test_async_tls_options_are_checked_at_construction(certs: Certs,
                                                       tmp_path: Path) -> None:
    require_library("nats", "AsyncNatsJetStreamBroker")
    from msgpatterns.aio import AsyncNatsJetStreamBroker

    with pytest.raises(ConfigurationError, match="not both"):
        AsyncNatsJetStreamBroker("tls://127.0.0.1:1", tls_ca_file=str(certs.ca),
                                 tls_context=ssl.create_default_context())
    with pytest.raises(ConfigurationError, match="CA file"):
        AsyncNatsJetStreamBroker("tls://127.0.0.1:1",
                                 tls_ca_file=str(tmp_path / "missing.pem"))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "msgpatterns", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_tls_ca_file(tls_server: int, certs: Certs) -> None:
    url = f"tls://127.0.0.1:{tls_server}"
    ok = _cli("dlq", "list", url, "--topic", "orders", "--tls-ca-file", str(certs.ca))
    assert ok.returncode == 0, ok.stderr
    refused = _cli("dlq", "list", url, "--topic", "orders")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and len(lines) == 1, refused.stderr
    assert "CERTIFICATE_VERIFY_FAILED" in lines[0]
    missing = _cli("dlq", "list", url, "--topic", "orders", "--tls-ca-file", "/nonexistent")
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    other = _cli("dlq", "list", "redis://127.0.0.1:1", "--topic", "orders",
                 "--tls-ca-file", str(certs.ca))
    assert other.returncode != 0 and "--tls-ca-file is for nats://" in other.stderr


def test_a_reconnect_to_a_server_now_without_tls_sends_nothing_in_plaintext(
        certs: Certs, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Connected over TLS; the server is replaced by a plaintext one on the same port
    (what an attacker in the path can fake). The client keeps trying, and refuses
    each time before CONNECT: nothing it sends is readable."""
    from msgpatterns.brokers import NatsJetStreamBroker

    port = free_port()
    server = start_server(tmp_path / "tls", port, certs)
    proxy = RecordingProxy(("127.0.0.1", port))
    broker = None
    try:
        broker = NatsJetStreamBroker(f"tls://alice:{SECRET}@127.0.0.1:{proxy.port}",
                                     tls_ca_file=str(certs.ca), connect_timeout=10)
        assert b"CONNECT {" not in proxy.sent  # the first CONNECT went inside TLS
        stop_server(server)
        server = start_server(tmp_path / "plain", port, None)
        caplog.set_level(logging.WARNING, logger="msgpatterns.brokers.nats")
        give_up = time.monotonic() + 30
        while "TlsNotOffered" not in caplog.text:
            assert time.monotonic() < give_up, "no reconnect attempt was refused"
            time.sleep(0.05)
        assert b"CONNECT {" not in proxy.sent and SECRET.encode() not in proxy.sent
        assert SECRET not in caplog.text
    finally:
        if broker is not None:
            with contextlib.suppress(BrokerError):
                broker.close()
        proxy.close()
        stop_server(server)
