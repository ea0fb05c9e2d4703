"""AsyncRedisLink: commands over the link's own connections (opened by redis-py, the
replies read by hiredis). One deadline per command (send and reply together): past
the client's socket_timeout it raises redis-py's TimeoutError (transient to the
checker's policy). A connection whose command failed mid-way (timeout, connection
lost, cancelled) is dropped, so a late reply is never read as the answer to the next
command; an error reply keeps it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError, NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeout

from msgpatterns.idempotency.redis_link import AsyncRedisLink
from msgpatterns.idempotency.redis_store import redis_transient

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


async def fake_server(on_ping: Callable[[asyncio.StreamWriter], None],
                      reached: asyncio.Event) -> asyncio.Server:
    """A server answering +OK to the handshake's commands; at PING it sets ``reached``
    and does ``on_ping(writer)`` instead of answering."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            if b"PING" in data:
                reached.set()
                on_ping(writer)
                continue
            writer.write(b"+OK\r\n" * (data.count(b"\r\n*") + data.startswith(b"*")))
        writer.close()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


@pytest.fixture
async def silent() -> AsyncIterator[tuple[AsyncRedisLink, asyncio.Event]]:
    """A link to a server that never answers PING (socket_timeout 0.2 s), and the
    event the server sets when PING has reached it."""
    reached = asyncio.Event()
    server = await fake_server(lambda writer: None, reached)
    port = server.sockets[0].getsockname()[1]
    client = redis.asyncio.Redis.from_url(f"redis://127.0.0.1:{port}/0?socket_timeout=0.2")
    link = AsyncRedisLink(client)
    yield link, reached
    await link.aclose()
    await client.aclose()
    server.close()


async def test_a_command_past_the_socket_timeout_raises_and_drops_its_connection(
    silent: tuple[AsyncRedisLink, asyncio.Event],
) -> None:
    link, reached = silent
    with pytest.raises(RedisTimeout) as caught:
        await link.call("PING")
    assert reached.is_set()
    assert isinstance(caught.value, redis_transient(redis))
    assert link._free == []  # the connection that missed its reply is gone


async def test_a_cancelled_command_drops_its_connection(
    silent: tuple[AsyncRedisLink, asyncio.Event],
) -> None:
    link, reached = silent
    call = asyncio.ensure_future(link.call("PING"))
    await reached.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert link._free == []


async def test_a_connection_lost_mid_command_is_a_transient_error_and_dropped() -> None:
    reached = asyncio.Event()
    server = await fake_server(lambda writer: writer.transport.abort(), reached)
    port = server.sockets[0].getsockname()[1]
    client = redis.asyncio.Redis.from_url(f"redis://127.0.0.1:{port}/0?socket_timeout=5")
    link = AsyncRedisLink(client)
    try:
        with pytest.raises(RedisConnectionError) as caught:
            await link.call("PING")
        assert isinstance(caught.value, redis_transient(redis))
        assert link._free == []
    finally:
        await link.aclose()
        await client.aclose()
        server.close()


@pytest.mark.parametrize("decode", [False, True])
async def test_replies_and_error_replies_as_redis_py_gives_them(
    redis_url: str, unique: str, decode: bool
) -> None:
    client = redis.asyncio.Redis.from_url(redis_url, decode_responses=decode)
    link = AsyncRedisLink(client)
    key = f"asyncsuites:link:{unique}"
    try:
        assert await link.call("SET", key, "é", "PX", 60_000) in (b"OK", "OK", True)
        assert await link.call("GET", key) == ("é" if decode else "é".encode())
        with pytest.raises(ResponseError, match="unknown command"):
            await link.call("NO-SUCH-COMMAND")
        assert len(link._free) == 1  # the server answered: the connection is kept
        with pytest.raises(NoScriptError):  # typed as redis-py types it: the store reloads
            await link.call("EVALSHA", "0" * 40, 0)
        with pytest.raises(DataError):  # what redis-py refuses to send, refused
            await link.call("GET", object())
        assert await link.call("DEL", key) == 1
        assert len(link._free) == 1
    finally:
        await link.aclose()
        await client.aclose()
