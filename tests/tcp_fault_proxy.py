"""FaultProxy: a small TCP proxy for fault tests (any protocol: AMQP, Redis, ...).

A client connects to ``proxy.port`` instead of the server's; each connection is piped to
the server by two threads. The test then injects faults on the wire, only on the
connections that go through this proxy (never on another client of a shared server):

* :meth:`FaultProxy.kill_all` closes every piped connection abruptly on both sides (a
  connection killed while idle, a NAT or load balancer dropping it);
* :meth:`FaultProxy.lose_next_reply` lets the requests through, drops the next bytes
  the server sends back and then closes that connection (a reply lost in flight: the
  server did the work, the client never hears of it);
* ``proxy.down`` (an Event): while set, new connections are closed at once (the server
  is unreachable); :attr:`FaultProxy.refused` counts them.

New connections are accepted and piped again after a fault (the server never went away).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

__all__ = ["FaultProxy"]


class _Pipe:
    """One client connection and its server connection."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client, self.server = client, server
        self.closed = threading.Event()

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


class FaultProxy:
    """Listens on 127.0.0.1 (``port``) and pipes each connection to ``upstream``."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._pipes: list[_Pipe] = []
        self._lock = threading.Lock()
        self._lose_reply = threading.Event()
        #: Set each time a reply was dropped (and its connection closed).
        self.reply_lost = threading.Event()
        self.connections = 0  # accepted so far
        #: While set, new connections are closed at once (the server seems down).
        self.down = threading.Event()
        self.refused = 0  # connections closed while down
        self._refusals = threading.Condition()
        self._stopped = threading.Event()
        threading.Thread(target=self._accept, name="fault-proxy-accept", daemon=True).start()

    def url(self, url: str) -> str:
        """``url`` (``scheme://user:pass@host:port/rest``) pointed at this proxy."""
        scheme, rest = url.split("://", 1)
        auth, _, tail = rest.rpartition("@")
        path = tail.split("/", 1)[1] if "/" in tail else ""
        return f"{scheme}://{auth + '@' if auth else ''}127.0.0.1:{self.port}/{path}"

    @property
    def live(self) -> int:
        """Connections piped now."""
        with self._lock:
            return sum(not p.closed.is_set() for p in self._pipes)

    def kill_all(self) -> int:
        """Close every piped connection on both sides; how many there were."""
        with self._lock:
            pipes = [p for p in self._pipes if not p.closed.is_set()]
        for pipe in pipes:
            pipe.close()
        return len(pipes)

    def lose_next_reply(self) -> None:
        """Drop the next bytes a server sends on any connection, then close it."""
        self.reply_lost.clear()
        self._lose_reply.set()

    def wait_refused(self, count: int, timeout: float) -> bool:
        """Wait until ``count`` connections were refused while :attr:`down`."""
        with self._refusals:
            return self._refusals.wait_for(lambda: self.refused >= count, timeout)

    def close(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self.kill_all()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the pipes ---------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.down.is_set():
                with contextlib.suppress(OSError):
                    client.close()
                with self._refusals:
                    self.refused += 1
                    self._refusals.notify_all()
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            pipe = _Pipe(client, server)
            with self._lock:
                self._pipes = [p for p in self._pipes if not p.closed.is_set()]
                self._pipes.append(pipe)
                self.connections += 1
            for source, target, replies in ((client, server, False), (server, client, True)):
                threading.Thread(target=self._pump, args=(pipe, source, target, replies),
                                 name="fault-proxy-pump", daemon=True).start()

    def _pump(self, pipe: _Pipe, source: socket.socket, target: socket.socket,
              replies: bool) -> None:
        try:
            for chunk in _chunks(source):
                if replies and self._lose_reply.is_set():
                    self._lose_reply.clear()
                    pipe.close()  # the reply never reaches the client
                    self.reply_lost.set()
                    return
                target.sendall(chunk)
        except OSError:
            pass
        finally:
            pipe.close()


def _chunks(sock: socket.socket) -> Iterator[bytes]:
    while True:
        data = sock.recv(65536)
        if not data:
            return
        yield data
