"""Issue 25 item 6: the health and metrics endpoints against clients that misbehave,
with raw sockets: idle connections are closed after the read timeout, connections over
``max_connections`` are answered 503 at once, and a client that hangs up before its
reply leaves no traceback on stderr. The socket timeouts below are generous bounds for
a loaded machine, never the thing measured."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import pytest

from msgpatterns import Consumer, InMemoryBroker, Message
from msgpatterns.errors import ConfigurationError
from msgpatterns.observability import HealthServer

pytestmark = pytest.mark.timeout(120)

GENEROUS = 30.0


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=GENEROUS)


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (fails after
    GENEROUS seconds)."""
    sock.settimeout(GENEROUS)
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def get(port: int, path: str) -> bytes:
    with connect(port) as sock:
        sock.sendall(f"GET {path} HTTP/1.0\r\nHost: x\r\n\r\n".encode())
        return read_until_closed(sock)


def served(reply: bytes) -> bool:
    """A real answer (a probe of a consumer that is not running is a 503 with JSON),
    not the 'busy' refusal."""
    return reply.startswith(b"HTTP/1.0 ") and not reply.endswith(b"busy\n")


def hang_up_hard(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0): the server's next write fails."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def consumer() -> Consumer:
    def ok(message: Message) -> None:
        pass

    return Consumer(InMemoryBroker(), ok, topics=["t"], group="g")


# -- each endpoint, behind one opener ------------------------------------------------------

Opener = Callable[..., AbstractContextManager[tuple[int, str, Callable[[], None]]]]


@contextmanager
def health(gate: threading.Event | None = None,
           **bounds: Any) -> Iterator[tuple[int, str, Callable[[], None]]]:
    """A HealthServer; with ``gate``, each probe waits for it before answering."""
    probed = consumer()
    if gate is not None:
        plain = probed.health
        probed.health = lambda: (gate.wait(GENEROUS), plain())[1]  # type: ignore[method-assign]
    with HealthServer(probed, port=0, **bounds) as server:
        yield server.port, "/livez", lambda: None


@contextmanager
def prometheus(gate: threading.Event | None = None,
               **bounds: Any) -> Iterator[tuple[int, str, Callable[[], None]]]:
    """serve_prometheus; with ``gate``, each scrape waits for it (an observable gauge's
    callback) before answering."""
    pytest.importorskip("prometheus_client")
    pytest.importorskip("opentelemetry.exporter.prometheus")
    from msgpatterns.observability import serve_prometheus

    with serve_prometheus(port=0, **bounds) as endpoint:
        if gate is not None:
            def wait(options: Any) -> list[Any]:
                gate.wait(GENEROUS)
                return []

            endpoint.meter_provider.get_meter("test").create_observable_gauge(
                "gate", callbacks=[wait])
        yield endpoint.port, "/metrics", lambda: None


@pytest.fixture(params=["health", "prometheus"])
def endpoint(request: pytest.FixtureRequest) -> Opener:
    return health if request.param == "health" else prometheus  # type: ignore[return-value]


def test_idle_clients_are_closed_by_default(endpoint: Opener) -> None:
    """Issue 25 item 6: 40 clients that connect and never send a byte are all closed by
    the server, with the default options: 32 by the read timeout, the 8 over the
    connection limit with a 503 at once; the endpoint answers a real request
    afterwards."""
    with endpoint() as (port, path, _), ExitStack() as stack:
        idle = [stack.enter_context(connect(port)) for _ in range(40)]
        replies = [read_until_closed(sock) for sock in idle]
        assert all(r == b"" or r.startswith(b"HTTP/1.0 503") for r in replies), replies
        # the default max_connections (32) held; the 8 beyond were refused at once
        assert sum(r.startswith(b"HTTP/1.0 503") for r in replies) == 40 - 32
        assert served(get(port, path))


def test_connections_over_the_limit_get_503_at_once(endpoint: Opener) -> None:
    """Issue 25 item 6: with max_connections=3 and 3 idle clients, a fourth connection
    is answered 503 and closed without waiting for the idle ones; once the read timeout
    closed them, requests are served again."""
    with endpoint(read_timeout=2.0, max_connections=3) as (port, path, _), \
            ExitStack() as stack:
        idle = [stack.enter_context(connect(port)) for _ in range(3)]
        idle[0].sendall(b"GET ")  # one of them sent half a request line
        with connect(port) as extra:
            assert read_until_closed(extra).startswith(b"HTTP/1.0 503")
        for sock in idle:
            assert read_until_closed(sock) in (b"", b"HTTP/1.0 408")  # closed by timeout
        assert served(get(port, path))


def test_a_client_that_hangs_up_leaves_no_traceback(
        endpoint: Opener, capfd: pytest.CaptureFixture[str]) -> None:
    """Issue 25 item 6: clients that send a request and reset the connection before
    the reply: nothing on stderr (HealthServer printed a traceback for each)."""
    gate = threading.Event()
    with endpoint(gate) as (port, path, _):
        for _ in range(5):
            gate.clear()
            sock = connect(port)
            sock.sendall(f"GET {path} HTTP/1.0\r\n\r\n".encode())
            hang_up_hard(sock)
            gate.set()
        gate.set()
        assert served(get(port, path))
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    assert "Broken pipe" not in err and "Connection reset" not in err, err


@pytest.mark.parametrize("bounds", [{"read_timeout": 0}, {"read_timeout": -1.0},
                                    {"read_timeout": float("inf")}, {"read_timeout": "5"},
                                    {"max_connections": 0}, {"max_connections": 2.5},
                                    {"max_connections": True}])
def test_bad_bounds_are_a_configuration_error(endpoint: Opener,
                                              bounds: dict[str, Any]) -> None:
    """Issue 25 item 6: the new options are checked at construction."""
    with pytest.raises(ConfigurationError), endpoint(**bounds):
        pass
