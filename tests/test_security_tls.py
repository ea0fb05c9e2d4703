"""Issue 25 item 8: one spelling of RabbitMQ's TLS files on both drivers.

aio-pika reads ``cafile``/``capath``/``certfile``/``keyfile`` from an ``amqps://`` URL;
the thread driver now takes the same names (pika wants them in ``ssl_options``), so one
URL works for ``RabbitMQBroker``, ``AsyncRabbitMQBroker`` and ``msgpatterns dlq``. The
context built verifies the server's certificate against that CA and its host name.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import pytest

from broker_harness import delete_rabbitmq_topology, drain
from msgpatterns.brokers.rabbitmq._tls import pika_url
from msgpatterns.errors import ConfigurationError

pika = pytest.importorskip("pika")


@pytest.fixture(scope="module")
def ca_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A throw-away self-signed CA certificate (openssl)."""
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "ca.pem", where / "ca.key"
    try:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes",
                        "-keyout", str(key), "-out", str(cert), "-days", "1",
                        "-subj", "/CN=msgpatterns test CA"],
                       check=True, capture_output=True, timeout=60)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"openssl is needed to make a test CA: {exc}")
    return cert


def test_pika_url_rewrites_aio_pika_spelling() -> None:
    url = "amqps://u:p@rabbit.example:5671/%2F?cafile=/ca.pem&heartbeat=30"
    rewritten = pika_url(url)
    assert rewritten.startswith("amqps://u:p@rabbit.example:5671/%2F?heartbeat=30&")
    assert "ssl_options=" in rewritten and "cafile" in rewritten
    for unchanged in ("amqps://h/", "amqp://h/?heartbeat=5",
                      "amqps://h/?ssl_options=%7B%27ca_certs%27%3A+%27%2Fca%27%7D"):
        assert pika_url(unchanged) == unchanged


@pytest.mark.parametrize("url", [
    "amqp://h/?cafile=/ca.pem",  # TLS files without TLS
    "amqps://h/?cafile=/ca.pem&ssl_options=%7B%7D",  # two spellings
])
def test_ambiguous_tls_urls_are_refused(url: str) -> None:
    with pytest.raises(ConfigurationError):
        pika_url(url)


def test_the_thread_driver_takes_cafile_and_verifies(ca_file: Path) -> None:
    """Issue 25 item 8: ``?cafile=`` on the sync driver gives a context that requires a
    certificate signed by that CA and checks the host name (pika passes the URL's
    host as server_hostname)."""
    from msgpatterns.brokers.rabbitmq import url_parameters

    params = url_parameters(f"amqps://guest:guest@localhost:5671/%2F?cafile={ca_file}")
    context = params.ssl_options.context
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname is True
    assert [c["subject"] for c in context.get_ca_certs()] == \
        [((("commonName", "msgpatterns test CA"),),)]
    assert params.host == "localhost"
    with pytest.raises(ConfigurationError):
        url_parameters("amqps://h/?cafile=/no/such/ca.pem")


def test_the_cli_takes_the_same_spelling(ca_file: Path) -> None:
    """The ``msgpatterns dlq`` command reads RabbitMQ URLs as the thread driver does:
    ``?cafile=`` is understood (a connection failure, exit 1), not an unknown URL
    parameter (a usage error, exit 2)."""
    url = f"amqps://guest:guest@127.0.0.1:1/%2F?cafile={ca_file}"
    result = subprocess.run([sys.executable, "-m", "msgpatterns", "dlq", "list", url,
                             "--topic", "t", "--group", "g"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert "cannot connect" in result.stderr, result.stderr


# -- end to end: a TLS proxy with a throw-away CA in front of the real RabbitMQ --------------


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def server_tls(ca_file: Path) -> tuple[Path, Path]:
    """A certificate for ``localhost`` signed by the test CA, and its key."""
    where = ca_file.parent
    key, csr, cert, ext = (where / n for n in ("srv.key", "srv.csr", "srv.pem", "srv.ext"))
    ext.write_text("subjectAltName=DNS:localhost\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
            "-subj", "/CN=localhost")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_file), "-CAkey",
            str(where / "ca.key"), "-CAcreateserial", "-out", str(cert), "-days", "1",
            "-extfile", str(ext))
    return cert, key


@pytest.fixture
def tls_proxy(rabbitmq_url: str, server_tls: tuple[Path, Path]) -> Iterator[int]:
    """A TLS port that forwards to the real RabbitMQ (each connection its own pair of
    pump threads); yields its port."""
    target = urlsplit(rabbitmq_url)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(*map(str, server_tls))
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()
    opened: list[socket.socket] = []

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def serve() -> None:
        while not stop.is_set():
            try:
                raw, _ = listener.accept()
            except OSError:
                return
            try:
                client = context.wrap_socket(raw, server_side=True)
            except (OSError, ssl.SSLError):  # a client that refused our certificate
                raw.close()
                continue
            upstream = socket.create_connection((target.hostname, target.port or 5672))
            opened.extend((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    stop.set()
    listener.close()
    for s in opened:
        with contextlib.suppress(OSError):
            s.close()


def amqps(rabbitmq_url: str, port: int, ca: Path) -> str:
    user = urlsplit(rabbitmq_url)
    return f"amqps://{user.username}:{user.password}@localhost:{port}/%2F?cafile={ca}"


@pytest.mark.rabbitmq
@pytest.mark.timeout(120)
def test_one_amqps_url_works_on_both_drivers_and_verifies(
        rabbitmq_url: str, tls_proxy: int, ca_file: Path, tmp_path: Path,
        unique: str) -> None:
    """Issue 25 item 8: the same ``amqps://...?cafile=`` URL carries messages through a
    TLS server on the thread driver and the asyncio driver; with another CA both
    refuse the server (certificate verification), never fall back to plaintext."""
    from msgpatterns.aio.rabbitmq import AsyncRabbitMQBroker
    from msgpatterns.brokers.rabbitmq import RabbitMQBroker
    from msgpatterns.errors import BrokerUnavailable

    url = amqps(rabbitmq_url, tls_proxy, ca_file)
    topic, group = f"tls-{unique}", f"g-{unique}"
    try:
        with RabbitMQBroker(url) as broker:
            broker.subscribe(topic, group)
            broker.publish(topic, b"over TLS, thread driver")
            got = drain(broker, topic, group, count=1, within=20)
            assert [m.raw_body for m in got] == [b"over TLS, thread driver"]
            broker.ack(got[0])

        async def on_asyncio() -> list[bytes]:
            async with AsyncRabbitMQBroker(url) as abroker:
                await abroker.publish(topic, b"over TLS, asyncio driver")
                for _ in range(200):
                    fetched = await abroker.fetch([topic], group, max_messages=1,
                                                  timeout=0.1)
                    if fetched:
                        await abroker.ack(fetched[0])
                        return [m.raw_body for m in fetched]
            return []

        assert anyio.run(on_asyncio) == [b"over TLS, asyncio driver"]
    finally:
        delete_rabbitmq_topology(rabbitmq_url, topic, group)

    other_ca = tmp_path / "other-ca.pem"
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
            str(tmp_path / "other.key"), "-out", str(other_ca), "-days", "1",
            "-subj", "/CN=someone else")
    wrong = amqps(rabbitmq_url, tls_proxy, other_ca)
    with pytest.raises(BrokerUnavailable) as caught:
        RabbitMQBroker(wrong, connect_timeout=5)
    assert "CERTIFICATE_VERIFY_FAILED" in repr_chain(caught.value)

    async def refused() -> None:
        async with AsyncRabbitMQBroker(wrong, connect_timeout=5) as abroker:
            await abroker.publish(topic, b"never sent")  # connects on first use

    with pytest.raises(BrokerUnavailable) as acaught:
        anyio.run(refused)
    assert "CERTIFICATE_VERIFY_FAILED" in repr_chain(acaught.value)


def repr_chain(error: BaseException | None) -> str:
    out = []
    while error is not None:
        out.append(repr(error))
        error = error.__cause__ or error.__context__
    return " <- ".join(out)
