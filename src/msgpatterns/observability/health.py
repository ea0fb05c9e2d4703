"""Consumer health: :class:`Health` (from ``Consumer.health()`` and
``AsyncConsumer.health()``) and :class:`HealthServer`, a tiny HTTP endpoint for liveness
and readiness probes.

``GET /livez`` answers 200 while every consumer is running (its threads, or its tasks
and event loop, alive), else 503; ``GET /readyz`` answers 200 while every consumer is
running and its last fetch succeeded (and its broker says it is connected, where the
broker can tell), else 503.
Both carry the health snapshots as JSON. Anything else is 404.

The server runs the standard library's ``ThreadingHTTPServer`` on one daemon thread,
binds ``127.0.0.1`` unless told otherwise, and is stopped by :meth:`HealthServer.close`
(or leaving its ``with`` block); ``close()`` is idempotent. It is bounded for clients
that misbehave (:mod:`msgpatterns.observability.endpoint`): a connection silent for
``read_timeout`` seconds is closed, at most ``max_connections`` are served at once (more
get 503), and a client that hangs up before its reply is no traceback.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from msgpatterns.errors import ConfigurationError
from msgpatterns.observability.endpoint import (
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_READ_TIMEOUT,
    BoundedHTTPServer,
)
from msgpatterns.observability.stats import Health
from msgpatterns.runtime.driver import DriverBase

if TYPE_CHECKING:
    from msgpatterns.aio.consumer import AsyncConsumer
    from msgpatterns.consumer import Consumer

__all__ = ["Health", "HealthServer"]


class HealthServer:
    """Serves ``/livez`` and ``/readyz`` for ``consumers`` on ``host:port`` (port 0: a
    free port, see :attr:`port`) from a daemon thread, until :meth:`close`.

    ``consumers`` are :class:`~msgpatterns.Consumer` and
    :class:`~msgpatterns.aio.AsyncConsumer` objects, mixed as you like: each probe
    calls their ``health()`` from the server's thread (an ``AsyncConsumer`` takes its
    snapshot on its own event loop and waits for it up to ``health_timeout``; a loop
    that does not answer in time is reported not running).

    ``read_timeout``: seconds a connection may stay silent before it is closed;
    ``max_connections``: connections served at once (more are answered 503)."""

    def __init__(self, *consumers: Consumer | AsyncConsumer, host: str = "127.0.0.1",
                 port: int = 0, read_timeout: float = DEFAULT_READ_TIMEOUT,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        if not consumers or not all(isinstance(c, DriverBase) for c in consumers):
            raise ConfigurationError(
                "HealthServer needs one or more Consumer or AsyncConsumer objects")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ConfigurationError(f"HealthServer port must be an int in 0..65535, got {port!r}")
        self.consumers = consumers
        self._server = BoundedHTTPServer((host, port), _handler_for(consumers),
                                         read_timeout=read_timeout,
                                         max_connections=max_connections)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="msgpatterns-health", daemon=True
        )
        self._thread.start()
        self._closed = False

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """``http://host:port``."""
        host = self._server.server_address[0]
        return f"http://{host!s}:{self.port}"

    def close(self) -> None:
        """Stop serving and free the port; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<HealthServer {self.url} {'closed' if self._closed else 'open'}>"


def _handler_for(
        consumers: tuple[Consumer | AsyncConsumer, ...]) -> type[BaseHTTPRequestHandler]:
    class _Probe(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path not in ("/livez", "/readyz"):
                self._send(404, {"error": f"unknown path {path}; use /livez or /readyz"})
                return
            snapshots = [consumer.health() for consumer in consumers]
            ok = all(s.live if path == "/livez" else s.ready for s in snapshots)
            self._send(200 if ok else 503, {"ok": ok,
                                            "consumers": [s.as_dict() for s in snapshots]})

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # probes every few seconds would flood the log

    return _Probe
