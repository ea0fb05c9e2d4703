"""RedisChecker: the idempotency state machine on Redis (redis-py, fakeredis).

Each key is one Redis string whose value is the state (``P`` or ``D``), the 32-hex
owner token, the optional payload fingerprint and, for a DONE key completed with
``store_result``, a newline and the stored result text (ASCII JSON, see
:mod:`msgpatterns.idempotency.results`). Every write sets an expiry: the
lease for PROCESSING, ``ttl`` for DONE, so no key ever lives forever and an expired
lease simply frees the key. Claim, complete and release are Lua scripts run by
``EVALSHA`` over any number of keys (keys and values travel as script KEYS and ARGV,
never as syntax): a single call and a batch call are each one round trip. A call of
one key (every guarded call of a handler) sends each script's single-key form, the
loop's body alone, which costs the server about half as much.

On Redis Cluster (a ``RedisCluster`` client) a batch becomes one pipeline of
single-key script calls, since one script may only touch keys of one hash slot.

:class:`AsyncRedisChecker` is the same on ``redis.asyncio`` for ``async def``
handlers: the same scripts, arguments and replies (:class:`RedisScripts`), awaited.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Unpack
from urllib.parse import quote

from msgpatterns._callables import renamed_arguments
from msgpatterns._extras import require
from msgpatterns._redispy import AsyncRedisLink, Prepacked, RedisLink
from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency.base import AsyncLeaseChecker, AsyncOptions, LeaseChecker
from msgpatterns.idempotency.guard import ClaimRequest
from msgpatterns.idempotency.policy import StorePolicy
from msgpatterns.idempotency.records import PROCESSING, Record
from msgpatterns.idempotency.spec import CheckerSpec, hide_password_in, policy_options, redact_url

if TYPE_CHECKING:
    import redis

__all__ = ["AsyncRedisChecker", "AsyncRedisStore", "RedisChecker", "RedisStore"]

# ARGV[1] lease in ms; ARGV[i + 1] "P" .. token .. fingerprint for KEYS[i].
# Per key: 1 when claimed, else {current value, its remaining ms}.
CLAIM = """
local out = {}
for i, key in ipairs(KEYS) do
  local v = redis.call('GET', key)
  if v then
    out[i] = {v, redis.call('PTTL', key)}
  else
    redis.call('SET', key, ARGV[i + 1], 'PX', ARGV[1])
    out[i] = 1
  end
end
return out
"""

# ARGV[1] ttl in ms; ARGV[3i - 1], ARGV[3i], ARGV[3i + 1]: token, fingerprint and
# stored result text ('' for none) of KEYS[i]. Per key: 1 when it is (now) DONE by
# that token - also when its lease expired and nobody took it - else 0.
COMPLETE = """
local out = {}
for i, key in ipairs(KEYS) do
  local token, fingerprint, result = ARGV[3 * i - 1], ARGV[3 * i], ARGV[3 * i + 1]
  local tail = ''
  if result ~= '' then tail = '\\n' .. result end
  local v = redis.call('GET', key)
  if not v then
    redis.call('SET', key, 'D' .. token .. fingerprint .. tail, 'PX', ARGV[1])
    out[i] = 1
  elseif string.sub(v, 2, 33) ~= token then
    out[i] = 0
  else
    if string.sub(v, 1, 1) == 'P' then
      redis.call('SET', key, 'D' .. string.sub(v, 2) .. tail, 'PX', ARGV[1])
    end
    out[i] = 1
  end
end
return out
"""

# ARGV[i]: token of KEYS[i]. Per key: 1 when its PROCESSING record held by that token
# was deleted, else 0.
RELEASE = """
local out = {}
for i, key in ipairs(KEYS) do
  local v = redis.call('GET', key)
  if v and string.sub(v, 1, 33) == 'P' .. ARGV[i] then
    out[i] = redis.call('DEL', key)
  else
    out[i] = 0
  end
end
return out
"""

# The same three scripts for one key (KEYS[1]), without the loop and the reply table:
# what a single guarded call sends. Redis runs a script's body in a few microseconds
# but pays about as much again per call for the loop and the table, and the server's
# time is part of every round trip. Same ARGV layout and per-key replies as above.
CLAIM_ONE = """
local v = redis.call('GET', KEYS[1])
if v then
  return {v, redis.call('PTTL', KEYS[1])}
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[1])
return 1
"""

COMPLETE_ONE = """
local token, fingerprint, result = ARGV[2], ARGV[3], ARGV[4]
local tail = ''
if result ~= '' then tail = '\\n' .. result end
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('SET', KEYS[1], 'D' .. token .. fingerprint .. tail, 'PX', ARGV[1])
  return 1
elseif string.sub(v, 2, 33) ~= token then
  return 0
end
if string.sub(v, 1, 1) == 'P' then
  redis.call('SET', KEYS[1], 'D' .. string.sub(v, 2) .. tail, 'PX', ARGV[1])
end
return 1
"""

RELEASE_ONE = """
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, 33) == 'P' .. ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

_CHUNK = 1000


@dataclass(slots=True)
class _Script:
    """A Lua script and its SHA-1 (what EVALSHA names it by). ``one``: its form for a
    single key (used for every call of one key); ``single``: this is such a form, whose
    reply is the key's own reply instead of a table of them."""

    script: str
    one: _Script | None = None
    single: bool = False
    sha: str = ""
    #: ``EVALSHA <sha> 1``, packed once: how a single-key form is called.
    command: Prepacked | None = None

    def __post_init__(self) -> None:
        self.sha = hashlib.sha1(self.script.encode("utf-8"), usedforsecurity=False).hexdigest()
        if self.single:
            self.command = Prepacked("EVALSHA", self.sha, 1)


#: One script call per chunk of keys: (script, keys, ARGV).
Call = tuple[_Script, list[bytes], list[Any]]


def _claim_argv(request: ClaimRequest) -> tuple[str]:
    """A claim's ARGV for its key: the PROCESSING value."""
    return ("P" + request.token + (request.fingerprint or ""),)


def _complete_argv(item: ClaimRequest) -> tuple[str, str, str]:
    """A completion's ARGV for its key: token, fingerprint and result text."""
    return item.token, item.fingerprint or "", item.result or ""


def _text(value: Any) -> str:
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


def _record(reply: Any, request: ClaimRequest, lease_ms: int) -> Record:
    """The record a claim reply describes: 1 (claimed) or [current value, its PTTL]."""
    if reply == 1:  # claimed (built without Record's Python __new__: the hot path)
        return tuple.__new__(Record, (PROCESSING, request.token, request.fingerprint,
                                      lease_ms / 1000, None))
    value, pttl = _text(reply[0]), int(reply[1])
    fingerprint, newline, result = value[33:].partition("\n")
    return Record(value[0], value[1:33], fingerprint or None, max(pttl, 0) / 1000,
                  result if newline else None)


class RedisScripts:
    """The three scripts and how each operation becomes calls of them (keys and values
    as script KEYS and ARGV, at most 1000 keys per call) and how their replies read:
    shared by the sync and the async store, which only send the calls."""

    def __init__(self, lease_ms: int, ttl_ms: int, *, chunk: int = _CHUNK) -> None:
        #: Keys per call: 1 on a Redis Cluster (one script may only touch keys of one
        #: hash slot; the store sends a batch as one pipeline of single-key calls).
        self.chunk = chunk
        self.lease_ms, self.ttl_ms = lease_ms, ttl_ms
        self.lease_word, self.ttl_word = b"%d" % lease_ms, b"%d" % ttl_ms
        self.claim, self.complete, self.release = (
            _Script(CLAIM, _Script(CLAIM_ONE, single=True)),
            _Script(COMPLETE, _Script(COMPLETE_ONE, single=True)),
            _Script(RELEASE, _Script(RELEASE_ONE, single=True)))

    def claim_calls(self, requests: Sequence[ClaimRequest]) -> list[Call]:
        return self.calls(self.claim, [r.key for r in requests], (self.lease_ms,),
                          [_claim_argv(r) for r in requests])

    def records(self, replies: list[Any], requests: Sequence[ClaimRequest]) -> list[Record]:
        return [_record(reply, request, self.lease_ms)
                for reply, request in zip(replies, requests, strict=True)]

    def complete_calls(self, items: Sequence[ClaimRequest]) -> list[Call]:
        return self.calls(self.complete, [item.key for item in items], (self.ttl_ms,),
                          [_complete_argv(item) for item in items])

    # One key (a single guarded call): the key and ARGV of the script's single-key form
    # (``script.one``, None on the plain path: then the batch script, by ``calls``),
    # without the batch's lists; the reply is that key's own.

    def claim_one(self, request: ClaimRequest) -> tuple[str, bytes, str]:
        return request.key, self.lease_word, \
            "P" + request.token + (request.fingerprint or "")

    def complete_one(self, item: ClaimRequest) -> tuple[str, bytes, str, str, str]:
        return item.key, self.ttl_word, item.token, item.fingerprint or "", item.result or ""

    def release_one(self, item: ClaimRequest) -> tuple[str, str]:
        return item.key, item.token

    def release_calls(self, items: Sequence[ClaimRequest]) -> list[Call]:
        return self.calls(self.release, [item.key for item in items], (),
                          [(item.token,) for item in items])

    def calls(self, script: _Script, keys: Sequence[str], shared: tuple[Any, ...],
              per_key: Sequence[tuple[Any, ...]]) -> list[Call]:
        """``script`` over ``keys``: ARGV is ``shared`` then each key's ``per_key``
        arguments; one call per ``chunk`` keys, by the script's single-key form when a
        call has one key."""
        if len(keys) == 1 and script.one is not None:  # a single guarded call
            return [(script.one, [keys[0].encode("utf-8")], [*shared, *per_key[0]])]
        calls: list[Call] = []
        chunk = self.chunk
        for start in range(0, len(keys), chunk):
            args = list(shared)
            for extra in per_key[start:start + chunk]:
                args.extend(extra)
            part = [key.encode("utf-8") for key in keys[start:start + chunk]]
            calls.append((script.one if len(part) == 1 and script.one is not None
                          else script, part, args))
        return calls


def redis_transient(redis_module: Any) -> tuple[type[BaseException], ...]:
    """The redis-py errors worth retrying (sync and asyncio clients raise the same)."""
    exc = redis_module.exceptions
    return (exc.ConnectionError, exc.TimeoutError, exc.BusyLoadingError,
            exc.ReadOnlyError, exc.TryAgainError, OSError)


def _url_of(client: redis.Redis) -> str:
    """A URL that reconnects to the server ``client`` talks to."""
    pool = client.connection_pool
    kwargs = pool.connection_kwargs
    name = pool.connection_class.__name__
    if "Fake" in name:
        raise ConfigurationError(
            "a RedisChecker on fakeredis cannot be rebuilt in another process; "
            "build it from a redis:// URL"
        )
    auth = ""
    if kwargs.get("password") is not None:
        auth = f"{quote(kwargs.get('username') or '', safe='')}:" \
               f"{quote(str(kwargs['password']), safe='')}@"
    db = kwargs.get("db", 0)
    if "UnixDomainSocket" in name:
        return f"unix://{auth}{kwargs['path']}?db={db}"
    scheme = "rediss" if "SSL" in name else "redis"
    return f"{scheme}://{auth}{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{db}"


class RedisChecker(LeaseChecker):
    """Idempotency on Redis, shared by every process that uses the same server.

    Args:
        url: a Redis URL, or a ``redis.Redis`` (or fakeredis) client (the old keyword
            ``client_or_url=`` still works). A checker
            built from a URL owns its client (``close()`` closes it), connects with
            short timeouts and leaves retries to this checker's ``policy``.
        namespace: first part of every key (``namespace:group:key``).
        ttl: seconds a DONE key is remembered.
        lease: seconds a claim holds a key; a crashed owner's key is free after it.
        max_key_bytes: longer keys are stored as their SHA-256.
        policy: retries and the NeedRetry delay when Redis is unreachable.
        write_behind: seconds within which a guarded call's completion is written in
            the background (one round trip per message instead of two; see
            :mod:`msgpatterns.idempotency.write_behind`). None (default): complete
            before returning.

    Crash semantics: at-least-once. If the process dies after the handler's effect and
    before completion, the key frees itself when the lease expires and the redelivered
    message is processed again. Use TransactionalSqlChecker for exactly-once effects.
    For ``async def`` handlers use :class:`AsyncRedisChecker`.
    """

    store: RedisStore

    @renamed_arguments(client_or_url="url")
    def __init__(
        self,
        url: redis.Redis | str,
        namespace: str = "msgpatterns",
        ttl: float | timedelta = 86400,
        lease: float | timedelta = 30,
        *,
        max_key_bytes: int = 512,
        policy: StorePolicy | None = None,
        write_behind: float | timedelta | None = None,
    ) -> None:
        redis_module = require("redis", "redis")
        if isinstance(url, str):
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            self.url: str | None = url
            client: redis.Redis = _from_url(redis_module.Redis, url,
                                            retry=Retry(NoBackoff(), 0))
            self._owns_client = True
        else:
            if _is_async_client(url):
                raise ConfigurationError(
                    "RedisChecker got a redis.asyncio client: use AsyncRedisChecker for "
                    "async def handlers (or a redis.Redis client here)")
            self.url = None
            client = url
            self._owns_client = False
        self.client = client
        options: dict[str, Any] = {
            "namespace": namespace, "ttl": ttl, "lease": lease, "max_key_bytes": max_key_bytes,
            "policy": policy, "write_behind": write_behind}
        scripts = _scripts(lease, ttl, cluster=hasattr(client, "get_nodes"))
        super().__init__(RedisStore(client, scripts), **options)
        self._link = self.store.link

    def purge(self, older_than: float | timedelta | None = None) -> int:
        """Nothing to do: Redis expires every key itself. Returns 0."""
        self._check_open()
        return 0

    def spec(self) -> CheckerSpec:
        """The URL and options that rebuild this checker in another process."""
        return CheckerSpec("redis", self.url or _url_of(self.client), {
            "namespace": self.namespace, "ttl": self.ttl, "lease": self.lease,
            "max_key_bytes": self.keys.max_bytes, "policy": policy_options(self.policy),
            "write_behind": self.write_behind,
        })

    def _where(self) -> str:
        if self.url is not None:
            return redact_url(self.url)
        try:
            return redact_url(_url_of(self.client))
        except ConfigurationError:
            return "fakeredis"

    def _close(self) -> None:
        self._link.close()
        if self._owns_client:
            self.client.close()


class AsyncRedisChecker(AsyncLeaseChecker):
    """:class:`RedisChecker` for ``async def`` handlers, on ``redis.asyncio``.

    The same keys, records, scripts and rules as :class:`RedisChecker` (the two read
    each other's keys); only the I/O is awaited. Arguments and defaults as for
    RedisChecker (the options keyword-only);
    ``url`` is a ``redis.asyncio.Redis`` client (or fakeredis'
    ``FakeAsyncRedis``) or a URL. ``write_behind`` (fast mode) writes completions from
    a task on the loop. Close with ``await checker.aclose()`` (or ``async with``).
    Redis Cluster is not supported here (use RedisChecker).
    """

    @renamed_arguments(client_or_url="url")
    def __init__(self, url: Any, **options: Unpack[AsyncOptions]) -> None:
        require("redis", "redis")
        import redis.asyncio

        if isinstance(url, str):
            self.url: str | None = url
            from redis.asyncio.retry import Retry as AsyncRetry
            from redis.backoff import NoBackoff

            self.client: Any = _from_url(redis.asyncio.Redis, url,
                                         retry=AsyncRetry(NoBackoff(), 0))
            self._owns_client = True
        else:
            if not _is_async_client(url):
                raise ConfigurationError(
                    "AsyncRedisChecker needs a redis.asyncio client (or a URL), got "
                    f"{type(url).__name__}; use RedisChecker for sync handlers")
            self.url, self.client, self._owns_client = None, url, False
        settings: dict[str, Any] = {"namespace": "msgpatterns", "ttl": 86400, "lease": 30,
                                    "max_key_bytes": 512, **options}
        store = AsyncRedisStore(self.client, _scripts(settings["lease"], settings["ttl"],
                                                      cluster=False))
        super().__init__(store, **settings)

    def _where(self) -> str:
        return redact_url(self.url) if self.url is not None else type(self.client).__name__

    async def _aclose(self) -> None:
        await self.astore.link.aclose()  # type: ignore[attr-defined]
        if self._owns_client:
            await self.client.aclose()


def _scripts(lease: float | timedelta, ttl: float | timedelta, *, cluster: bool) -> RedisScripts:
    from msgpatterns.errors import seconds

    return RedisScripts(max(1, int((seconds(lease) or 0.0) * 1000)),
                        max(1, int((seconds(ttl) or 0.0) * 1000)), chunk=1 if cluster else _CHUNK)


def _is_async_client(client: object) -> bool:
    import inspect

    return inspect.iscoroutinefunction(getattr(client, "execute_command", None))


def _from_url(cls: Any, url: str, **options: Any) -> Any:
    """A client for ``url`` with short timeouts, retries left to the checker's policy;
    a URL that does not parse is a ConfigurationError that never shows the password."""
    try:
        return cls.from_url(url, socket_connect_timeout=2.0, socket_timeout=5.0, **options)
    except ValueError as error:
        raise ConfigurationError(
            f"cannot use Redis URL {redact_url(url)!r}: {hide_password_in(str(error), url)}"
        ) from None


class _Store:
    """What both Redis stores hold: the client, the scripts, redis-py's errors."""

    def __init__(self, client: Any, scripts: RedisScripts) -> None:
        redis_module = require("redis", "redis")
        self.client = client
        self.scripts = scripts
        self.transient = redis_transient(redis_module)
        self._no_script: type[BaseException] = redis_module.exceptions.NoScriptError


class RedisStore(_Store):
    """The sync lease store on Redis: the scripts sent over a :class:`RedisLink` (one
    connection per thread), or as one pipeline of single-key calls on a cluster."""

    client: redis.Redis

    def __init__(self, client: redis.Redis, scripts: RedisScripts) -> None:
        super().__init__(client, scripts)
        self.link = RedisLink(client)

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Record]:
        scripts = self.scripts
        one = scripts.claim.one
        if len(requests) == 1 and one is not None:  # a single guarded call
            request = requests[0]
            reply = self._script(one, scripts.claim_one(request))
            return [_record(reply, request, scripts.lease_ms)]
        return scripts.records(self._run(scripts.claim_calls(requests)), requests)

    def complete_many(self, items: Sequence[ClaimRequest]) -> list[bool]:
        one = self.scripts.complete.one
        if len(items) == 1 and one is not None:
            return [self._script(one, self.scripts.complete_one(items[0])) == 1]
        return [reply == 1 for reply in self._run(self.scripts.complete_calls(items))]

    def release_many(self, items: Sequence[ClaimRequest]) -> list[bool]:
        one = self.scripts.release.one
        if len(items) == 1 and one is not None:
            return [self._script(one, self.scripts.release_one(items[0])) == 1]
        return [reply == 1 for reply in self._run(self.scripts.release_calls(items))]

    def _script(self, script: _Script, rest: tuple[Any, ...]) -> Any:
        """One call of a single-key script (its ``EVALSHA`` head packed once),
        re-loading the script if the server lost it."""
        assert script.command is not None
        try:
            return self.link.script(script.command, rest)
        except self._no_script:
            self.link.call("SCRIPT", "LOAD", script.script)
            return self.link.script(script.command, rest)

    def _run(self, calls: list[Call]) -> list[Any]:
        if len(calls) > 1 and self.scripts.chunk == 1:  # a cluster
            return self._pipelined(calls)
        replies: list[Any] = []
        for script, keys, args in calls:
            reply = self._eval(script, keys, args)
            if script.single:
                replies.append(reply)
            else:
                replies.extend(reply)
        return replies

    def _eval(self, script: _Script, keys: list[bytes], args: list[Any]) -> Any:
        """One script call, re-loading the script if the server lost it (restart,
        failover, SCRIPT FLUSH)."""
        call = self.link.call
        try:
            return call("EVALSHA", script.sha, len(keys), *keys, *args)
        except self._no_script:
            call("SCRIPT", "LOAD", script.script)
            return call("EVALSHA", script.sha, len(keys), *keys, *args)

    def _pipelined(self, calls: list[Call]) -> list[Any]:
        """Each key's script call, all in one pipeline (one round trip).

        Every script here can run twice with the same arguments and give the same
        answer, so a pipeline that met a flushed script cache is simply sent again.
        """
        for _ in range(2):
            pipe = self.client.pipeline(transaction=False)
            for script, keys, args in calls:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            answers = pipe.execute(raise_on_error=False)
            if not any(isinstance(a, self._no_script) for a in answers):
                break
            for source in {script.script for script, _, _ in calls}:
                self.client.script_load(source)
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        return [answer if script.single else answer[0]
                for (script, _, _), answer in zip(calls, answers, strict=True)]


class AsyncRedisStore(_Store):
    """The async lease store on ``redis.asyncio``: the same scripts and replies as
    :class:`RedisStore`, awaited."""

    async def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Record]:
        scripts = self.scripts
        one = scripts.claim.one
        if len(requests) == 1 and one is not None:  # a single guarded call
            request = requests[0]
            reply = await self._script(one, scripts.claim_one(request))
            return [_record(reply, request, scripts.lease_ms)]
        return scripts.records(await self._run(scripts.claim_calls(requests)), requests)

    async def complete_many(self, items: Sequence[ClaimRequest]) -> list[bool]:
        one = self.scripts.complete.one
        if len(items) == 1 and one is not None:
            return [await self._script(one, self.scripts.complete_one(items[0])) == 1]
        return [reply == 1 for reply in await self._run(self.scripts.complete_calls(items))]

    async def release_many(self, items: Sequence[ClaimRequest]) -> list[bool]:
        one = self.scripts.release.one
        if len(items) == 1 and one is not None:
            return [await self._script(one, self.scripts.release_one(items[0])) == 1]
        return [reply == 1 for reply in await self._run(self.scripts.release_calls(items))]

    async def _script(self, script: _Script, rest: tuple[Any, ...]) -> Any:
        """One call of a single-key script, re-loading the script if the server lost
        it."""
        assert script.command is not None
        try:
            return await self.link.script(script.command, rest)
        except self._no_script:
            await self.link.call("SCRIPT", "LOAD", script.script)
            return await self.link.script(script.command, rest)

    def __init__(self, client: Any, scripts: RedisScripts) -> None:
        super().__init__(client, scripts)
        self.link = AsyncRedisLink(client)

    async def _run(self, calls: list[Call]) -> list[Any]:
        replies: list[Any] = []
        for script, keys, args in calls:
            reply = await self._eval(script, keys, args)
            if script.single:
                replies.append(reply)
            else:
                replies.extend(reply)
        return replies

    async def _eval(self, script: _Script, keys: list[bytes], args: list[Any]) -> Any:
        """One script call, re-loading the script if the server lost it."""
        call = self.link.call
        try:
            return await call("EVALSHA", script.sha, len(keys), *keys, *args)
        except self._no_script:
            await call("SCRIPT", "LOAD", script.script)
            return await call("EVALSHA", script.sha, len(keys), *keys, *args)
