"""Issue 25 item 8: one spelling of RabbitMQ's TLS files on both drivers.

aio-pika reads ``cafile``/``capath``/``certfile``/``keyfile`` from an ``amqps://`` URL;
the thread driver now takes the same names (pika wants them in ``ssl_options``), so one
URL works for ``RabbitMQBroker``, ``AsyncRabbitMQBroker`` and ``msgpatterns dlq``. The
context built verifies the server's certificate against that CA and its host name.
"""

from __future__ import annotations

import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from msgpatterns.brokers._amqp_tls import pika_url
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
