"""Everything below redis-py's client API, in one module: redis-py's connection
classes and pool settings, raw replies, its reply parser (``redis._parsers``), an
asyncio connection's transport and hiredis. A release that moves one of these breaks
this module only; each use has a fallback to redis-py's own client path, and
``.ci/redis-versions.sh`` runs the Redis tests on the oldest and newest redis-py the
package allows.

* :class:`RedisLink` / :class:`AsyncRedisLink`: the checkers' commands over private
  connections. A checker sends one or two commands per message, so the client's
  per-command work (taking a connection from the pool and giving it back,
  instrumentation hooks) costs as much as the network round trip itself. Each thread
  (or task) here keeps its own connection, built like the client's pool would build it
  (same class and settings: address, auth, TLS, protocol, timeouts), and talks through
  redis-py's ``Connection`` directly. Only plain connection pools are used this way;
  any other client (Sentinel, Cluster, custom pools) goes through
  ``client.execute_command``. A connection error drops the connection (the next call
  reconnects); the checker's policy decides about retries.
* :func:`pool_connection`, :func:`send_commands`, :func:`read_reply`,
  :func:`release`, :func:`drop` and :func:`read_with_retry`: a pool connection used
  directly by the Redis Streams adapters (several commands in one write, replies read
  raw, before any response callback).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from msgpatterns.errors import CheckerClosed

if TYPE_CHECKING:
    import redis

__all__ = [
    "AsyncRedisLink",
    "RedisLink",
    "drop",
    "error_parser",
    "hiredis_available",
    "pool_connection",
    "read_reply",
    "read_with_retry",
    "release",
    "send_commands",
    "stream_transport",
    "sync_twin",
]


class Prepacked:
    """``EVALSHA <sha> <numkeys>`` (or any command's fixed first words) packed once in
    the Redis protocol; each call packs only its own words (:meth:`pack`): bytes, str
    (UTF-8) or int, as redis-py would send them. The words are in ``words`` for
    clients the links talk to through redis-py."""

    __slots__ = ("count", "head", "words")

    def __init__(self, *words: bytes | str | int) -> None:
        self.words = words
        self.count = len(words)
        self.head = b"".join(_bulk(word) for word in words)

    def pack(self, rest: tuple[Any, ...]) -> bytes:
        """The whole command, the fixed words then ``rest``; ``DataError`` for a word
        of another type (nothing is sent)."""
        count = self.count + len(rest)
        parts = [_ARRAYS[count] if count < _TABLE else b"*%d\r\n" % count, self.head]
        for word in rest:
            kind = type(word)
            data = word if kind is bytes else word.encode() if kind is str else \
                b"%d" % word if kind is int else _refused(word)
            size = len(data)
            parts += (_SIZES[size] if size < _TABLE else b"$%d\r\n" % size, data, b"\r\n")
        return b"".join(parts)


#: The RESP headers of arrays and strings of fewer than ``_TABLE`` items or bytes, made
#: once (formatting a number is most of the cost of packing a short command).
_TABLE = 512
_ARRAYS = [b"*%d\r\n" % size for size in range(_TABLE)]
_SIZES = [b"$%d\r\n" % size for size in range(_TABLE)]


def _bulk(word: bytes | str | int) -> bytes:
    data = word if type(word) is bytes else str(word).encode()
    return b"$%d\r\n%b\r\n" % (len(data), data)


def _refused(word: object) -> bytes:
    from redis.exceptions import DataError

    raise DataError(f"Invalid input of type: {type(word).__name__!r}. Convert to a "
                    "bytes, string or int first.")


def _reader_options(kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """How redis-py builds its hiredis reader for a connection with ``kwargs`` (None:
    without hiredis or its error parser, the links talk through redis-py's
    connection)."""
    from redis.exceptions import InvalidResponse

    parse_error = error_parser()
    if parse_error is None or not hiredis_available():
        return None
    options: dict[str, Any] = {"protocolError": InvalidResponse, "replyError": parse_error,
                               "notEnoughData": _INCOMPLETE}
    if kwargs.get("decode_responses"):
        options.update(encoding=kwargs.get("encoding", "utf-8"),
                       errors=kwargs.get("encoding_errors", "strict"))
    return options


class _Line:
    """One connection of a :class:`RedisLink` once redis-py has opened it (and
    authenticated, selected the database, negotiated the protocol): a command is
    written to its socket and its reply parsed by a hiredis reader built as redis-py
    builds its own - no packer, health check or parser layers between the caller and
    the socket. ``reader`` is None when that is not possible (no hiredis, RESP3, a
    health-check interval): the command then goes through redis-py's connection.

    An I/O error or a timeout disconnects it (``broken``: the link opens another, the
    error is redis-py's ``ConnectionError`` or ``TimeoutError``); an error reply keeps
    it, as redis-py does (a reply that is a connection error, such as ``LOADING``,
    drops it, as redis-py does)."""

    __slots__ = ("broken", "buffer", "conn", "reader", "sock")

    def __init__(self, conn: Any, reader_options: dict[str, Any] | None) -> None:
        self.conn = conn
        self.broken = False
        self.reader: Any = None
        self.sock: Any = getattr(conn, "_sock", None)  # fakeredis has no socket
        if reader_options is not None and isinstance(self.sock, socket.socket) \
                and (push_type() is not None or str(getattr(conn, "protocol", 2)) == "2") \
                and not getattr(conn, "health_check_interval", 0):
            import hiredis

            self.reader = hiredis.Reader(**reader_options)
            self.buffer = bytearray(65536)

    def exchange(self, packed: bytes) -> Any:
        """Send one packed command and return its reply (error replies raise)."""
        sock, reader = self.sock, self.reader
        try:
            sock.sendall(packed)
            reply = reader.gets()
            while reply is _INCOMPLETE or type(reply) is _PUSH:  # a push is not a reply
                if reply is _INCOMPLETE:
                    size = sock.recv_into(self.buffer)
                    if not size:
                        raise OSError("Connection closed by server.")
                    reader.feed(self.buffer, 0, size)
                reply = reader.gets()
        except OSError as error:  # a timeout included
            raise self._dropped(error) from None
        except BaseException:  # e.g. a reply hiredis cannot parse, an interrupt
            self._drop()
            raise
        if isinstance(reply, Exception):
            from redis.exceptions import ConnectionError as RedisConnectionError

            if isinstance(reply, RedisConnectionError):
                self._drop()  # e.g. LOADING: redis-py drops the connection too
            raise reply
        return reply

    def via_redis_py(self, packed: bytes) -> Any:
        """:meth:`exchange` through redis-py's connection (which reconnects itself
        after an I/O error)."""
        conn = self.conn
        conn.send_packed_command([packed])
        return conn.read_response()

    def _drop(self) -> None:
        self.broken = True
        with contextlib.suppress(Exception):
            self.conn.disconnect()

    def _dropped(self, error: OSError) -> Exception:
        """redis-py's error for a failed exchange (as its connection raises it), the
        connection dropped."""
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeout

        self._drop()
        if isinstance(error, TimeoutError):  # socket.timeout
            return RedisTimeout("Timeout reading from socket")
        return RedisConnectionError(f"Error while talking to Redis: {error}")


class RedisLink:
    """Sends commands for one checker, thread-safely: each thread over a connection of
    its own (a :class:`_Line`), built like the client's pool would build it."""

    def __init__(self, client: redis.Redis) -> None:
        from redis.connection import ConnectionPool

        self.client = client
        pool = getattr(client, "connection_pool", None)
        self._direct = type(pool) is ConnectionPool  # fakeredis uses one too
        self._pool = pool
        self._local = threading.local()
        self._creating = threading.Lock()
        self._open: weakref.WeakSet[Any] = weakref.WeakSet()
        self._reader_options = _reader_options(pool.connection_kwargs) \
            if self._direct and pool is not None else None
        # With hiredis, a command of several words is packed by it, as redis-py does.
        self._pack: Callable[[tuple[Any, ...]], bytes] | None = None
        if self._reader_options is not None:
            import hiredis

            self._pack = hiredis.pack_command
        # a forked child must not talk over its parent's sockets: it starts afresh
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._local = threading.local()
        self._open = weakref.WeakSet()

    #: Set by close(): no command is sent afterwards (a retry of a command the close cut
    #: off would otherwise reconnect).
    closed = False

    def call(self, *args: Any) -> Any:
        """Send one command and return its reply (error replies raise);
        :class:`~msgpatterns.errors.CheckerClosed` after :meth:`close`."""
        if self.closed:
            raise CheckerClosed("the checker is closed: its Redis connections are released")
        if not self._direct:
            return self.client.execute_command(*args)  # type: ignore[no-untyped-call]
        line = self._line()
        if line.reader is None:
            conn = line.conn
            conn.send_command(*args)
            return conn.read_response()
        assert self._pack is not None
        try:
            packed = self._pack(args)
        except TypeError as error:  # a value redis-py would not send either
            from redis.exceptions import DataError

            raise DataError(str(error)) from None
        return line.exchange(packed)

    def script(self, command: Prepacked, rest: tuple[Any, ...]) -> Any:
        """:meth:`call` of ``command``'s words then ``rest``, the fixed words packed
        once (a checker's script calls: ``EVALSHA <sha> 1`` then the key and its
        arguments)."""
        if self.closed:
            raise CheckerClosed("the checker is closed: its Redis connections are released")
        if not self._direct:
            return self.client.execute_command(  # type: ignore[no-untyped-call]
                *command.words, *rest)
        line = self._line()
        packed = command.pack(rest)
        if line.reader is None:
            return line.via_redis_py(packed)
        return line.exchange(packed)

    def _line(self) -> _Line:
        line: _Line | None = getattr(self._local, "line", None)
        if line is None or line.broken:  # a new thread, a forked child, a dropped one
            assert self._pool is not None
            with self._creating:  # one at a time, as the pool does (fakeredis needs it)
                conn = self._pool.connection_class(**self._pool.connection_kwargs)
                conn.connect()
            line = _Line(conn, self._reader_options)
            self._local.line = line
            self._open.add(conn)
        return line

    def close(self) -> None:
        """Close every thread's connection; afterwards :meth:`call` refuses. A
        connection that fails to close (in use by another thread at that moment) is
        left to its own error: the others are closed all the same."""
        self.closed = True
        for conn in list(self._open):
            with contextlib.suppress(Exception):  # closing the rest matters more
                conn.disconnect()


class _Wire(asyncio.Protocol):
    """One connection of an :class:`AsyncRedisLink` once redis-py has opened it (and
    authenticated, selected the database, negotiated the protocol): its replies go
    straight to a hiredis reader built as redis-py builds it, and the reply completes
    the caller's future - no stream reader, no parser coroutines between the socket
    and the caller (they cost three times the event loop's own round trip)."""

    __slots__ = ("closed", "conn", "deadline", "lost", "reader", "transport", "waiter")

    def __init__(self, conn: Any, transport: asyncio.Transport, reader: Any) -> None:
        self.conn, self.transport, self.reader = conn, transport, reader
        self.waiter: asyncio.Future[Any] | None = None
        self.deadline = 0.0
        #: The connection is gone (closed by the server, killed, reset): set by the
        #: event loop as soon as it sees the end of the stream, idle or not.
        self.lost = False
        self.closed = asyncio.get_running_loop().create_future()
        transport.set_protocol(self)

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        waiter = self.waiter
        if waiter is None:
            return  # nothing asked: the caller finds the connection out of step
        reply = self.reader.gets()
        while type(reply) is _PUSH:  # not the reply of the command sent
            reply = self.reader.gets()
        if reply is not _INCOMPLETE:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        from redis.exceptions import ConnectionError as RedisConnectionError

        self.lost = True
        self.fail(RedisConnectionError("Connection closed by server."))
        if not self.closed.done():
            self.closed.set_result(None)

    async def drop(self) -> None:
        """Close at once, whatever is unsent or unread."""
        self.transport.abort()
        await self.conn.disconnect(nowait=True)

    async def close(self) -> None:
        """Close once what is written is sent (the way redis-py closes)."""
        self.transport.close()
        await self.conn.disconnect(nowait=True)
        await self.closed

    def fail(self, error: BaseException) -> None:
        """End the command waiting for a reply with ``error``."""
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)


_INCOMPLETE = object()  # what the hiredis reader returns until a reply is complete


def push_type() -> type | None:
    """The type of a RESP3 push message as the hiredis reader returns it (None without
    hiredis, or a hiredis too old to tell a push from a reply)."""
    try:
        import hiredis
    except ImportError:
        return None
    found: type | None = getattr(hiredis, "PushNotification", None)
    return found


class _NoPush:
    """Never a reply's type (no hiredis, or one without push messages)."""


#: A push message arriving on a link's connection (RESP3: e.g. a server's maintenance
#: notice) is skipped: it is not the reply of the command sent.
_PUSH: type = push_type() or _NoPush


def hiredis_available() -> bool:
    """True when redis-py parses with hiredis (it is installed and redis-py uses it)."""
    from redis.utils import HIREDIS_AVAILABLE

    return bool(HIREDIS_AVAILABLE)


def error_parser() -> Callable[[str], Exception] | None:
    """How redis-py types an error reply (a private name of redis-py: if a release
    moves it, this is None and the link talks through redis-py's own connection)."""
    try:
        from redis._parsers import BaseParser
    except ImportError:
        return None
    parse_error: Callable[[str], Exception] | None = getattr(BaseParser, "parse_error", None)
    return parse_error


def stream_transport(conn: Any) -> asyncio.Transport | None:
    """The asyncio transport under an open ``redis.asyncio`` connection (a private
    attribute of redis-py: None when a release moves it, or for a connection without
    one, as fakeredis's; the link then talks through redis-py's connection)."""
    transport = getattr(getattr(conn, "_writer", None), "transport", None)
    return transport if isinstance(transport, asyncio.Transport) else None


class AsyncRedisLink:
    """:class:`RedisLink` for ``redis.asyncio``: commands over the link's own
    connections, one per task talking at the same moment (kept in a free list), each
    built and opened by redis-py like the client's pool does. With hiredis (the
    parser redis-py uses when it is installed) the replies are read by
    :class:`_Wire`; without it through redis-py's connection.

    A connection the server closed while it sat idle in the free list (``CLIENT KILL``,
    ``timeout``, a restart) is noticed before anything is written to it: the event loop
    marks it lost as soon as the end of its stream arrives, and a command never goes
    out on a lost connection - it is sent on a fresh one instead (nothing was sent yet,
    so that is safe for any command). A connection that dies once the command is
    written fails that command at once with redis-py's ``ConnectionError`` (transient
    to the checker's policy, which sends it again or raises ``StoreUnavailable``): the
    link cannot know whether the server ran it.

    A command past the client's ``socket_timeout`` (send and reply together) raises
    redis-py's ``TimeoutError``; one deadline watch per link checks the commands in
    flight every quarter of it, so a command times out within 1.25 timeouts. A
    connection whose command failed mid-way (an I/O error, a timeout, a cancelled
    task) is dropped; an error reply (the server answered) keeps it. Clients with
    other pools go through ``execute_command``."""

    def __init__(self, client: Any) -> None:
        from redis.asyncio.connection import ConnectionPool
        from redis.exceptions import ResponseError

        self.client = client
        pool = getattr(client, "connection_pool", None)
        self._direct = type(pool) is ConnectionPool
        self._pool = pool
        self._free: list[Any] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # The link's connections are built without socket_timeout: redis-py would wrap
        # every send in a task of its own (asyncio.wait_for) and every read in a timer.
        kwargs = dict(pool.connection_kwargs) if pool is not None and self._direct else {}
        self._timeout: float | None = kwargs.get("socket_timeout")
        kwargs["socket_timeout"] = None
        self._kwargs = kwargs
        self._busy: set[_Wire] = set()
        self._response_error = ResponseError
        self._watch: asyncio.TimerHandle | None = None
        # With hiredis, commands are packed and replies parsed by it, as the sync client
        # does (the caller passes each word of a command as an argument of its own).
        self._pack: Callable[[tuple[Any, ...]], bytes] | None = None
        self._reader_options = _reader_options(kwargs) if self._direct else None
        if self._reader_options is not None:
            import hiredis

            self._pack = hiredis.pack_command

    def _bound(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # connections belong to the loop that opened them
            self._loop, self._free, self._busy, self._watch = loop, [], set(), None
        return loop

    async def call(self, *args: Any) -> Any:
        """Send one command and return its reply (error replies raise)."""
        if not self._direct:
            return await self.client.execute_command(*args)
        loop = self._bound()
        conn = await self._take()
        try:
            if type(conn) is _Wire:
                assert self._pack is not None
                try:
                    packed = self._pack(args)
                except TypeError as error:  # a value redis-py would not send either
                    from redis.exceptions import DataError

                    raise DataError(str(error)) from None
            else:
                packed = conn.pack_command(*args)
        except BaseException:
            self._free.append(conn)  # nothing was sent
            raise
        if type(conn) is _Wire:
            return await self._send(loop, conn, packed)
        return await self._send_by_redis_py(conn, packed)

    async def script(self, command: Prepacked, rest: tuple[Any, ...]) -> Any:
        """:meth:`call` of ``command``'s words then ``rest``, the fixed words packed
        once (see :meth:`RedisLink.script`)."""
        if not self._direct:
            return await self.client.execute_command(*command.words, *rest)
        packed = command.pack(rest)  # a word it cannot send fails before anything else
        loop = self._bound()
        free = self._free
        if free:  # the usual case, without a coroutine of its own: a free wire still open
            conn = free[-1]
            if type(conn) is _Wire and not conn.lost and not conn.transport.is_closing():
                free.pop()
                return await self._send(loop, conn, packed)
        conn = await self._take()
        if type(conn) is _Wire:
            return await self._send(loop, conn, packed)
        return await self._send_by_redis_py(conn, packed)

    async def _take(self) -> Any:
        """A free connection that is still open, or a new one: connections the server
        closed while they were idle are dropped on the way (never written to)."""
        free = self._free
        while free:
            conn = free.pop()
            if type(conn) is not _Wire:
                return conn  # redis-py's own connection notices a closed stream itself
            if not conn.lost and not conn.transport.is_closing():
                return conn
            await conn.drop()
        return await self._open()

    async def _open(self) -> Any:
        assert self._pool is not None
        conn = self._pool.connection_class(**self._kwargs)
        await conn.connect()
        if self._reader_options is not None:
            import hiredis

            transport = stream_transport(conn)
            if transport is not None:  # fakeredis has no transport
                return _Wire(conn, transport, hiredis.Reader(**self._reader_options))
        return conn

    async def _send(self, loop: asyncio.AbstractEventLoop, wire: _Wire,
                    packed: bytes) -> Any:
        wire.waiter = waiter = loop.create_future()
        wire.transport.write(packed)  # a connection lost from here on fails the waiter
        if self._timeout is not None:
            wire.deadline = loop.time() + self._timeout
            self._busy.add(wire)
            if self._watch is None:
                self._watch = loop.call_later(self._timeout / 4, self._check_deadlines)
        try:
            reply = await waiter
        except BaseException:
            await wire.drop()
            raise
        finally:
            self._busy.discard(wire)
        if isinstance(reply, Exception):
            if not isinstance(reply, self._response_error):
                await wire.drop()  # e.g. LOADING: redis-py drops the connection too
                raise reply
            self._free.append(wire)  # the server answered: the connection is in step
            raise reply
        self._free.append(wire)
        return reply

    def _check_deadlines(self) -> None:
        """The deadline watch: fail the commands past their deadline."""
        from redis.exceptions import TimeoutError as RedisTimeout

        self._watch = None
        assert self._loop is not None and self._timeout is not None
        now = self._loop.time()
        for wire in [wire for wire in self._busy if wire.deadline <= now]:
            self._busy.discard(wire)
            wire.fail(RedisTimeout(f"Timeout after {self._timeout}s talking to Redis"))
        if self._busy:
            self._watch = self._loop.call_later(self._timeout / 4, self._check_deadlines)

    async def _send_by_redis_py(self, conn: Any, packed: Any) -> Any:
        from redis.exceptions import ResponseError
        from redis.exceptions import TimeoutError as RedisTimeout

        try:
            if self._timeout is None:
                await conn.send_packed_command(packed)
                reply = await conn.read_response()
            else:
                async with asyncio.timeout(self._timeout):
                    await conn.send_packed_command(packed)
                    reply = await conn.read_response()
        except ResponseError:
            self._free.append(conn)  # the server answered: the connection is in step
            raise
        except TimeoutError as error:  # the deadline passed: the reply may still come
            await conn.disconnect(nowait=True)
            if isinstance(error, RedisTimeout):
                raise
            raise RedisTimeout(f"Timeout after {self._timeout}s talking to Redis") from None
        except BaseException:
            await conn.disconnect(nowait=True)
            raise
        self._free.append(conn)
        return reply

    async def aclose(self) -> None:
        """Close the link's connections (used again, it reconnects)."""
        free, self._free = self._free, []
        if self._loop is not asyncio.get_running_loop():
            return  # another loop's connections: they went with it
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
        for conn in free:
            await (conn.close() if type(conn) is _Wire else conn.disconnect())


# -- a pool connection used directly (the Redis Streams adapters) ------------------------


def sync_twin(client: Any) -> Any:
    """A sync ``redis.Redis`` with the connection settings of ``client`` (a
    ``redis.asyncio.Redis``: address or socket path, TLS, credentials, database,
    protocol, timeouts), on a pool of its own; the caller closes it."""
    import redis
    import redis.asyncio

    pool = client.connection_pool
    options = dict(pool.connection_kwargs)
    kind: Any
    if "path" in options:
        kind = redis.UnixDomainSocketConnection
    elif isinstance(pool.connection_class, type) and issubclass(
            pool.connection_class, redis.asyncio.SSLConnection):
        kind = redis.SSLConnection
    else:
        kind = redis.Connection
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=kind,
                                                            **options))


def pool_connection(client: Any) -> Any:
    """A connection of ``client``'s pool, to give back with :func:`release` (or
    :func:`drop` and then :func:`release` when a reply may still be on its way)."""
    pool = client.connection_pool
    try:
        return pool.get_connection()
    except TypeError:  # redis-py < 5.3 wants a command name
        return pool.get_connection("XREADGROUP")


def release(client: Any, conn: Any) -> None:
    """Give ``conn`` back to ``client``'s pool."""
    client.connection_pool.release(conn)


def drop(conn: Any) -> None:
    """Disconnect ``conn`` (whatever is unsent or unread is gone; the pool reconnects
    it on next use)."""
    conn.disconnect()


def send_commands(conn: Any, commands: Sequence[Sequence[Any]]) -> None:
    """Write ``commands`` on ``conn`` in one write (their replies are read with
    :func:`read_reply`, in order)."""
    conn.send_packed_command(conn.pack_commands(commands))


def read_reply(conn: Any) -> Any:
    """The next reply on ``conn`` as the connection reads it, before any response
    callback (an error reply raises redis-py's ``ResponseError``)."""
    return conn.read_response()


async def read_with_retry(client: Any, command: Callable[[], Sequence[Any]],
                          lost: Callable[[], None]) -> Any:
    """``command()`` sent on a connection of ``client``'s (``redis.asyncio``) pool and
    its raw reply read, both again (``command()`` built again) as the connection's own
    ``Retry`` decides when the connection fails; ``lost()`` is called before each
    reconnect (the reply of that attempt is gone). A failure the retry gives up on
    disconnects the connection (a reply may still be on its way)."""
    pool = client.connection_pool
    conn = await pool.get_connection()

    async def attempt() -> Any:
        await conn.send_command(*command())
        return await conn.read_response()

    async def failed(error: Exception) -> None:
        lost()
        await conn.disconnect()

    call: Callable[..., Awaitable[Any]] = conn.retry.call_with_retry
    try:
        return await call(attempt, failed)
    except BaseException:
        await conn.disconnect(nowait=True)  # a reply may still be on its way
        raise
    finally:
        await pool.release(conn)
