"""AsyncRedisLink's deadline: one per command (send and reply together), on the link's
own connections; a command past it raises redis-py's TimeoutError (a transient error
to the checker's policy) and drops its connection, so a late reply is never read as
the answer to the next command."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio
from redis.exceptions import TimeoutError as RedisTimeout

from msgpatterns.idempotency.redis_link import AsyncRedisLink
from msgpatterns.idempotency.redis_store import redis_transient

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


async def test_a_command_past_the_socket_timeout_raises_and_drops_its_connection() -> None:
    silent = asyncio.Event()  # set once the server has swallowed a command unanswered

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            if b"PING" in data:  # the handshake's other commands are answered +OK
                silent.set()
                continue
            writer.write(b"+OK\r\n" * data.count(b"\r\n*"))
            writer.write(b"+OK\r\n" if data.startswith(b"*") else b"")
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = redis.asyncio.Redis.from_url(f"redis://127.0.0.1:{port}/0?socket_timeout=0.2")
    link = AsyncRedisLink(client)
    try:
        with pytest.raises(RedisTimeout) as caught:
            await link.call("PING")
        assert silent.is_set()
        assert isinstance(caught.value, redis_transient(redis))
        assert link._free == []  # the connection that missed its reply is gone
    finally:
        await link.aclose()
        await client.aclose()
        server.close()
        await server.wait_closed()
