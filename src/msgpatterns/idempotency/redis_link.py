"""Commands to Redis over one private connection per thread.

A checker sends one or two commands per message, so the client's per-command work
(taking a connection from the pool and giving it back, instrumentation hooks) costs
as much as the network round trip itself. Each thread here keeps its own connection,
built like the client's pool would build it (same class and settings: address, auth,
TLS, protocol, timeouts), and talks through redis-py's ``Connection`` directly.

Only plain connection pools are used this way; any other client (Sentinel, Cluster,
custom pools) goes through ``client.execute_command``. A connection error drops the
connection (the next call reconnects); the checker's policy decides about retries.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis

__all__ = ["AsyncRedisLink", "RedisLink"]


class RedisLink:
    """Sends commands for one checker, thread-safely."""

    def __init__(self, client: redis.Redis) -> None:
        from redis.connection import ConnectionPool

        self.client = client
        pool = getattr(client, "connection_pool", None)
        self._direct = type(pool) is ConnectionPool  # fakeredis uses one too
        self._pool = pool
        self._local = threading.local()
        self._creating = threading.Lock()
        self._open: weakref.WeakSet[Any] = weakref.WeakSet()
        # a forked child must not talk over its parent's sockets: it starts afresh
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._local = threading.local()
        self._open = weakref.WeakSet()

    def call(self, *args: Any) -> Any:
        """Send one command and return its reply (error replies raise)."""
        if not self._direct:
            return self.client.execute_command(*args)  # type: ignore[no-untyped-call]
        conn = self._connection()
        conn.send_command(*args)
        return conn.read_response()

    def _connection(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:  # a new thread (or a forked child)
            assert self._pool is not None
            with self._creating:  # one at a time, as the pool does (fakeredis needs it)
                conn = self._pool.connection_class(**self._pool.connection_kwargs)
                conn.connect()
            self._local.conn = conn
            self._open.add(conn)
        return conn

    def close(self) -> None:
        """Close every thread's connection (each reconnects if used again)."""
        for conn in list(self._open):
            conn.disconnect()


class AsyncRedisLink:
    """:class:`RedisLink` for ``redis.asyncio``: commands over the link's own
    connections, one per task talking at the same moment (kept in a free list), each
    built like the client's pool builds them. A connection whose command failed
    mid-way (an I/O error, a cancelled task) is dropped; an error reply (the server
    answered) keeps it. Clients with other pools go through ``execute_command``."""

    def __init__(self, client: Any) -> None:
        from redis.asyncio.connection import ConnectionPool

        self.client = client
        pool = getattr(client, "connection_pool", None)
        self._direct = type(pool) is ConnectionPool
        self._pool = pool
        self._free: list[Any] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # One deadline per command (send and reply together) instead of redis-py's own
        # per-step timeouts: with a socket_timeout it wraps every send in a task of its
        # own (asyncio.wait_for) and every read in a timer, twice the cost of the
        # round trip's bookkeeping. The link's connections are built without it.
        kwargs = dict(pool.connection_kwargs) if self._direct else {}
        self._timeout: float | None = kwargs.get("socket_timeout")
        kwargs["socket_timeout"] = None
        self._kwargs = kwargs

    async def call(self, *args: Any) -> Any:
        """Send one command and return its reply (error replies raise)."""
        if not self._direct:
            return await self.client.execute_command(*args)
        from redis.exceptions import ResponseError
        from redis.exceptions import TimeoutError as RedisTimeout

        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # connections belong to the loop that opened them
            self._loop, self._free = loop, []
        free = self._free
        if free:
            conn = free.pop()
        else:
            assert self._pool is not None
            conn = self._pool.connection_class(**self._kwargs)
            await conn.connect()
        try:
            if self._timeout is None:
                await conn.send_command(*args)
                reply = await conn.read_response()
            else:
                async with asyncio.timeout(self._timeout):
                    await conn.send_command(*args)
                    reply = await conn.read_response()
        except ResponseError:
            free.append(conn)  # the server answered: the connection is in step
            raise
        except TimeoutError as error:  # the deadline passed: the reply may still come
            await conn.disconnect(nowait=True)
            if isinstance(error, RedisTimeout):
                raise
            raise RedisTimeout(f"Timeout after {self._timeout}s talking to Redis") from None
        except BaseException:
            await conn.disconnect(nowait=True)
            raise
        free.append(conn)
        return reply

    async def aclose(self) -> None:
        """Close the link's connections (used again, it reconnects)."""
        free, self._free = self._free, []
        if self._loop is not asyncio.get_running_loop():
            return  # another loop's connections: they went with it
        for conn in free:
            await conn.disconnect()
