"""A TCP proxy for fault tests: it forwards both ways, and loses chosen replies.

``LossyProxy(host, port)`` listens on a free local port. Every connection is forwarded
to ``host:port`` as it is, until a client write matches ``doom`` (a predicate on the
bytes of one write) while faults remain: that request is forwarded, the server's
reply is read and thrown away (the server did the work) and both sides are closed, as
when a connection dies with the reply on the wire. ``every=n`` dooms every n-th
matching write, at most ``most`` of them; ``lost`` counts those done.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable


class LossyProxy:
    def __init__(self, host: str, port: int, *, doom: Callable[[bytes], bool],
                 every: int = 1, most: int = 1) -> None:
        self.target = (host, port)
        self.doom, self.every, self.most = doom, every, most
        self.matched = 0
        self.lost = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = threading.Event()
        self._sockets: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="lossy-proxy", daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            sockets, self._sockets = set(self._sockets), set()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> LossyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets |= {client, server}
            doomed = threading.Event()
            threading.Thread(target=self._requests, args=(client, server, doomed),
                             daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client, doomed),
                             daemon=True).start()

    def _should_doom(self, data: bytes) -> bool:
        if not self.doom(data):
            return False
        with self._lock:
            self.matched += 1
            if self.lost >= self.most or self.matched % self.every:
                return False
            self.lost += 1
            return True

    def _requests(self, client: socket.socket, server: socket.socket,
                  doomed: threading.Event) -> None:
        try:
            while data := client.recv(65536):
                if not doomed.is_set() and self._should_doom(data):
                    doomed.set()  # before the server can answer
                server.sendall(data)
        except OSError:
            pass
        self._end(client, server)

    def _replies(self, server: socket.socket, client: socket.socket,
                 doomed: threading.Event) -> None:
        try:
            while data := server.recv(65536):
                if doomed.is_set():
                    break  # the reply is lost with the connection
                client.sendall(data)
        except OSError:
            pass
        self._end(client, server)

    def _end(self, *sockets: socket.socket) -> None:
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
