"""The HTTP server behind :class:`~msgpatterns.observability.HealthServer` and
:func:`~msgpatterns.observability.serve_prometheus`: the standard library's
``ThreadingHTTPServer`` with the bounds an endpoint reachable by strangers needs.

* **Read timeout.** Every connection's socket gives up after ``read_timeout`` seconds
  without a byte (``StreamRequestHandler.timeout``): an idle client holds its thread
  for that long, not forever.
* **Bounded connections.** At most ``max_connections`` connections are served at once;
  one more is answered ``503 Service Unavailable`` and closed at once, without a thread.
  Probes and scrapes are one short request each, so the default (32) is far above what
  a Kubernetes kubelet or a Prometheus server opens.
* **Quiet hang-ups.** A client that closes its connection (or times out) before its
  reply is normal on a network: it is logged at DEBUG on ``msgpatterns.observability``,
  never printed as a traceback. Any other handler failure is logged (with its
  traceback) on that logger, never written to stderr by ``socketserver``.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from msgpatterns.errors import ConfigurationError

__all__ = [
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_READ_TIMEOUT",
    "BoundedHTTPServer",
    "check_bounds",
]

log = logging.getLogger("msgpatterns.observability")

#: Seconds a connection may stay silent before it is closed.
DEFAULT_READ_TIMEOUT = 5.0
#: Connections served at once; more are answered 503 and closed.
DEFAULT_MAX_CONNECTIONS = 32

_BUSY = (b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\n"
         b"Content-Length: 5\r\nConnection: close\r\n\r\nbusy\n")


def check_bounds(owner: str, read_timeout: float, max_connections: int) -> None:
    """A :class:`ConfigurationError` naming ``owner`` unless ``read_timeout`` is a
    positive number of seconds and ``max_connections`` an int >= 1."""
    if isinstance(read_timeout, bool) or not isinstance(read_timeout, int | float) \
            or not 0 < read_timeout < float("inf"):
        raise ConfigurationError(f"{owner} read_timeout must be a positive number of "
                                 f"seconds, got {read_timeout!r}")
    if isinstance(max_connections, bool) or not isinstance(max_connections, int) \
            or max_connections < 1:
        raise ConfigurationError(f"{owner} max_connections must be an int >= 1, "
                                 f"got {max_connections!r}")


class BoundedHTTPServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` on daemon threads whose handler class gets
    ``read_timeout`` as its socket timeout, serving at most ``max_connections`` at
    once (see the module docstring)."""

    daemon_threads = True
    #: The listen backlog: socketserver's default (5) leaves the connections of a burst
    #: waiting for the kernel's SYN-ACK retries (seconds each) instead of being
    #: accepted - and served or refused - at once.
    request_queue_size = socket.SOMAXCONN

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler],
                 *, read_timeout: float = DEFAULT_READ_TIMEOUT,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        check_bounds(type(self).__name__, read_timeout, max_connections)
        bounded = type(handler.__name__, (handler,), {"timeout": float(read_timeout)})
        self.read_timeout = float(read_timeout)
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        if ":" in address[0]:  # an IPv6 address, e.g. "::1" or "::"
            self.address_family = socket.AF_INET6
        super().__init__(address, bounded)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)  # starts the thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request: socket.socket) -> None:
        try:
            request.settimeout(0.0)  # never wait on a client we refuse
            request.send(_BUSY)
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A hang-up or a timeout: DEBUG. Anything else: logged with its traceback
        (``socketserver`` would print it to stderr)."""
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError | TimeoutError):
            log.debug("%s: client %s went away: %r", type(self).__name__,
                      client_address, error)
        else:
            log.exception("%s: serving %s failed", type(self).__name__, client_address)
