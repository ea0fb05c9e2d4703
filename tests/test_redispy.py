"""``msgpatterns._redispy``: the one module that reaches below redis-py's client API.

No other module of the library touches redis-py's connections, raw replies, reply parser
or hiredis. Each internal the module uses has a fallback to redis-py's own path, taken
when a release moves it; here each internal is taken away in turn and the fallback must
give the same replies and the same errors as the fast path, on the real server.
(``.ci/redis-versions.sh`` runs these and the other Redis tests on the oldest and the
newest redis-py the package allows.)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("redis")
import redis
import redis.asyncio
from redis.exceptions import DataError, NoScriptError, ResponseError

from msgpatterns import _redispy

SRC = Path(__file__).parent.parent / "src" / "msgpatterns"

#: What only msgpatterns/_redispy.py may use: redis-py's reply parser, an asyncio
#: connection's stream, a connection's own send/read calls and retry, taking a
#: connection from a pool, and hiredis.
BELOW_THE_CLIENT_API = re.compile(
    r"redis\._parsers|\bhiredis\b|[\"']_writer[\"']|\.read_response\(|\.send_command\("
    r"|\.send_packed_command\(|\.pack_commands?\(|\.get_connection\(|\.call_with_retry\(")


def test_only_redispy_reaches_below_the_client_api() -> None:
    users = sorted(str(path.relative_to(SRC)) for path in SRC.rglob("*.py")
                   if BELOW_THE_CLIENT_API.search(path.read_text(encoding="utf-8")))
    assert users == ["_redispy.py"]


# -- the async link: each internal taken away ------------------------------------------

def _no_error_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_redispy, "error_parser", lambda: None)


def _no_hiredis(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_redispy, "hiredis_available", lambda: False)


def _no_transport(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_redispy, "stream_transport", lambda conn: None)


FALLBACKS: dict[str, Callable[[pytest.MonkeyPatch], None] | None] = {
    "internals": None,
    "no redis._parsers": _no_error_parser,
    "no hiredis": _no_hiredis,
    "no transport": _no_transport,
}


async def _script(link: _redispy.AsyncRedisLink, key: str) -> list[Any]:
    """A few commands, their replies and errors as (kind, value) pairs."""
    out: list[Any] = []
    for args in (("SET", key, "é", "PX", 60_000), ("GET", key), ("INCR", key),
                 ("NO-SUCH-COMMAND",), ("EVALSHA", "0" * 40, 0), ("GET", object()),
                 ("DEL", key), ("GET", key)):
        try:
            out.append(("reply", await link.call(*args)))
        except DataError as exc:  # refused before sending: by hiredis or by redis-py
            out.append((type(exc).__name__, None))
        except (NoScriptError, ResponseError) as exc:  # the server's answer
            out.append((type(exc).__name__, str(exc).split(" ")[0]))
    return out


@pytest.mark.redis
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("fallback", list(FALLBACKS))
async def test_each_fallback_gives_the_replies_and_errors_of_the_fast_path(
    redis_url: str, unique: str, fallback: str, monkeypatch: pytest.MonkeyPatch,
    anyio_backend: str,
) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    fast = _redispy.AsyncRedisLink(client)
    take_away = FALLBACKS[fallback]
    if take_away is not None:
        take_away(monkeypatch)
    link = _redispy.AsyncRedisLink(client)
    try:
        expected = await _script(fast, f"redispy:{unique}:fast")
        got = await _script(link, f"redispy:{unique}:fallback")
        assert got == expected
        assert expected[0] in (("reply", b"OK"), ("reply", True))
        assert [kind for kind, _ in expected[3:6]] == [
            "ResponseError", "NoScriptError", "DataError"]
        kinds = {type(conn).__name__ for conn in link._free}
        fast_path = take_away is None and _redispy.hiredis_available()
        assert kinds == ({"_Wire"} if fast_path else kinds - {"_Wire"})
    finally:
        await fast.aclose()
        await link.aclose()
        await client.aclose()


# -- the sync link: each internal taken away -------------------------------------------


def _sync_script(link: _redispy.RedisLink, key: str) -> list[Any]:
    """The async script's commands on the sync link, then the same through a command
    whose first words are packed once (``script``)."""
    out: list[Any] = []
    sent: list[tuple[Callable[[], Any]]] = [
        (lambda args=args: link.call(*args),)
        for args in (("SET", key, "é", "PX", 60_000), ("GET", key), ("INCR", key),
                     ("NO-SUCH-COMMAND",), ("EVALSHA", "0" * 40, 0), ("GET", object()),
                     ("DEL", key), ("GET", key))]
    evalsha = _redispy.Prepacked("EVALSHA", "0" * 40, 1)
    setter = _redispy.Prepacked("SET")
    sent += [(lambda: link.script(setter, (key, b"v", "PX", 60_000)),),
             (lambda: link.script(_redispy.Prepacked("GET"), (key,)),),
             (lambda: link.script(evalsha, (key,)),),
             (lambda: link.script(setter, (key, object())),),
             (lambda: link.script(_redispy.Prepacked("DEL"), (key,)),)]
    for (send,) in sent:
        try:
            out.append(("reply", send()))
        except DataError as exc:  # refused before sending
            out.append((type(exc).__name__, None))
        except (NoScriptError, ResponseError) as exc:  # the server's answer
            out.append((type(exc).__name__, str(exc).split(" ")[0]))
    return out


@pytest.mark.redis
@pytest.mark.parametrize("fallback", ["internals", "no redis._parsers", "no hiredis"])
def test_the_sync_link_falls_back_to_the_replies_and_errors_of_its_fast_path(
    redis_url: str, unique: str, fallback: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = redis.Redis.from_url(redis_url)
    fast = _redispy.RedisLink(client)
    take_away = FALLBACKS[fallback]
    if take_away is not None:
        take_away(monkeypatch)
    link = _redispy.RedisLink(client)
    try:
        expected = _sync_script(fast, f"redispy:{unique}:sync-fast")
        got = _sync_script(link, f"redispy:{unique}:sync-fallback")
        assert got == expected
        assert expected[0] in (("reply", b"OK"), ("reply", True))
        assert [kind for kind, _ in expected[3:6]] == [
            "ResponseError", "NoScriptError", "DataError"]
        assert [kind for kind, _ in expected[8:]] == [
            "reply", "reply", "NoScriptError", "DataError", "reply"]
        assert expected[9] == ("reply", b"v")
        fast_path = take_away is None and _redispy.hiredis_available()
        assert (link._line().reader is not None) == fast_path
    finally:
        fast.close()
        link.close()
        client.close()


def test_a_prepacked_command_is_what_hiredis_packs() -> None:
    hiredis = pytest.importorskip("hiredis")
    command = _redispy.Prepacked("EVALSHA", "a" * 40, 1)
    rest = ("k:é", b"30000", "Ptoken", 7, b"")
    assert command.pack(rest) == hiredis.pack_command(("EVALSHA", "a" * 40, 1, *rest))


# -- a pool connection used directly ----------------------------------------------------


class _OldPool:
    """A pool as redis-py < 5.3 has it: get_connection wants a command name."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def get_connection(self, command_name: str, *keys: Any, **options: Any) -> str:
        self.asked.append(command_name)
        return "connection"


def test_pool_connection_falls_back_to_a_command_name() -> None:
    class Client:
        connection_pool = _OldPool()

    assert _redispy.pool_connection(Client()) == "connection"
    assert Client.connection_pool.asked == ["XREADGROUP"]


@pytest.mark.redis
def test_commands_on_a_pool_connection_read_raw_replies(redis_url: str, unique: str) -> None:
    client = redis.Redis.from_url(redis_url)
    key = f"redispy:{unique}:raw"
    conn = _redispy.pool_connection(client)
    try:
        _redispy.send_commands(conn, [("SET", key, "1"), ("INCR", key), ("GET", key),
                                      ("DEL", key)])
        assert [_redispy.read_reply(conn) for _ in range(4)] == [b"OK", 2, b"2", 1]
    finally:
        _redispy.release(client, conn)
        client.close()


@pytest.mark.redis
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_sync_twin_talks_to_the_same_server(redis_url: str, unique: str,
                                                      anyio_backend: str) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    twin = _redispy.sync_twin(client)
    key = f"redispy:{unique}:twin"
    try:
        await client.set(key, "from async", px=60_000)
        assert twin.get(key) == b"from async"
        assert twin.connection_pool.connection_kwargs["host"] == \
            client.connection_pool.connection_kwargs["host"]
    finally:
        twin.delete(key)
        twin.close()
        await client.aclose()


@pytest.mark.redis
def test_a_sync_command_past_the_socket_timeout_raises_and_drops_its_connection(
        redis_url: str, unique: str) -> None:
    from redis.exceptions import TimeoutError as RedisTimeout

    client = redis.Redis.from_url(redis_url, socket_timeout=0.2)
    link = _redispy.RedisLink(client)
    try:
        first = link.call("CLIENT", "ID")
        with pytest.raises(RedisTimeout):
            link.call("BLPOP", f"redispy:{unique}:never", 5)  # no reply within 0.2 s
        assert link.call("CLIENT", "ID") != first  # the late reply is never read
        assert link.call("PING") in (b"PONG", True)
    finally:
        link.close()
        client.close()
