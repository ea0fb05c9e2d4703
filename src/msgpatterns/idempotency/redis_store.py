"""RedisChecker: the idempotency state machine on Redis (redis-py, fakeredis).

Each key is one Redis string whose value is the state (``P`` or ``D``), the 32-hex
owner token, the optional payload fingerprint and, for a DONE key completed with
``store_result``, a newline and the stored result text (ASCII JSON, see
:mod:`msgpatterns.idempotency.results`). Every write sets an expiry: the
lease for PROCESSING, ``ttl`` for DONE, so no key ever lives forever and an expired
lease simply frees the key. Claim, complete and release are Lua scripts run by
``EVALSHA`` over any number of keys (keys and values travel as script KEYS and ARGV,
never as syntax): a single call and a batch call are each one round trip.

On Redis Cluster (a ``RedisCluster`` client) a batch becomes one pipeline of
single-key script calls, since one script may only touch keys of one hash slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from msgpatterns._callables import renamed_arguments
from msgpatterns._extras import require
from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency.base import ClaimRequest, LeaseChecker
from msgpatterns.idempotency.policy import StorePolicy
from msgpatterns.idempotency.records import PROCESSING, Record
from msgpatterns.idempotency.redis_link import RedisLink
from msgpatterns.idempotency.spec import CheckerSpec, hide_password_in, policy_options, redact_url

if TYPE_CHECKING:
    import redis

__all__ = ["RedisChecker"]

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

_CHUNK = 1000


def _text(value: Any) -> str:
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


def _record(reply: Any, request: ClaimRequest, lease_ms: int) -> Record:
    """The record a claim reply describes: 1 (claimed) or [current value, its PTTL]."""
    if reply == 1:
        return Record(PROCESSING, request.token, request.fingerprint, lease_ms / 1000)
    value, pttl = _text(reply[0]), int(reply[1])
    fingerprint, newline, result = value[33:].partition("\n")
    return Record(value[0], value[1:33], fingerprint or None, max(pttl, 0) / 1000,
                  result if newline else None)


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
    """

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
        super().__init__(namespace=namespace, ttl=ttl, lease=lease,
                         max_key_bytes=max_key_bytes, policy=policy, write_behind=write_behind)
        exc = redis_module.exceptions
        self.transient = (exc.ConnectionError, exc.TimeoutError, exc.BusyLoadingError,
                          exc.ReadOnlyError, exc.TryAgainError, OSError)
        self._no_script = exc.NoScriptError
        if isinstance(url, str):
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            self.url: str | None = url
            try:
                self.client: redis.Redis = redis_module.Redis.from_url(
                    url, retry=Retry(NoBackoff(), 0), socket_connect_timeout=2.0,
                    socket_timeout=5.0,
                )
            except ValueError as error:
                raise ConfigurationError(
                    f"cannot use Redis URL {redact_url(url)!r}: "
                    f"{hide_password_in(str(error), url)}"
                ) from None
            self._owns_client = True
        else:
            self.url = None
            self.client = url
            self._owns_client = False
        #: A Redis Cluster client: batches go out as pipelines of single-key calls.
        self._cluster = hasattr(self.client, "get_nodes")
        self._link = RedisLink(self.client)
        self._lease_ms = max(1, int(self.lease * 1000))
        self._ttl_ms = max(1, int(self.ttl * 1000))
        self._claim_script = self.client.register_script(CLAIM)
        self._complete_script = self.client.register_script(COMPLETE)
        self._release_script = self.client.register_script(RELEASE)

    # -- I/O ----------------------------------------------------------------------------

    def _claim_record(self, request: ClaimRequest) -> Record:
        value = "P" + request.token + (request.fingerprint or "")
        (reply,) = self._eval(self._claim_script, [request.key.encode("utf-8")],
                              [self._lease_ms, value])
        return _record(reply, request, self._lease_ms)

    def _complete_record(self, item: ClaimRequest) -> bool:
        (reply,) = self._eval(self._complete_script, [item.key.encode("utf-8")],
                              [self._ttl_ms, item.token, item.fingerprint or "",
                               item.result or ""])
        return bool(reply == 1)

    def _claim_records(self, requests: Sequence[ClaimRequest]) -> list[Record]:
        replies = self._run(self._claim_script, [r.key for r in requests], (self._lease_ms,),
                            [("P" + r.token + (r.fingerprint or ""),) for r in requests])
        return [_record(reply, request, self._lease_ms)
                for reply, request in zip(replies, requests, strict=True)]

    def _complete_records(self, items: Sequence[ClaimRequest]) -> list[bool]:
        replies = self._run(self._complete_script, [item.key for item in items],
                            (self._ttl_ms,),
                            [(item.token, item.fingerprint or "", item.result or "")
                             for item in items])
        return [reply == 1 for reply in replies]

    def _release_records(self, items: Sequence[ClaimRequest]) -> list[bool]:
        replies = self._run(self._release_script, [item.key for item in items], (),
                            [(item.token,) for item in items])
        return [reply == 1 for reply in replies]

    def _run(self, script: Any, keys: Sequence[str], shared: tuple[Any, ...],
             per_key: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``script`` over ``keys``: ARGV is ``shared`` then each key's ``per_key``
        arguments. One call per 1000 keys; one pipeline of single-key calls on a
        cluster."""
        if self._cluster and len(keys) > 1:
            return self._pipelined(script, keys, shared, per_key)
        replies: list[Any] = []
        for start in range(0, len(keys), _CHUNK):
            args = list(shared)
            for extra in per_key[start:start + _CHUNK]:
                args.extend(extra)
            chunk = [key.encode("utf-8") for key in keys[start:start + _CHUNK]]
            replies.extend(self._eval(script, chunk, args))
        return replies

    def _eval(self, script: Any, keys: list[bytes], args: list[Any]) -> Any:
        """One script call, re-loading the script if the server lost it (restart,
        failover, SCRIPT FLUSH)."""
        call = self._link.call
        try:
            return call("EVALSHA", script.sha, len(keys), *keys, *args)
        except self._no_script:
            script.sha = _text(call("SCRIPT", "LOAD", script.script))
            return call("EVALSHA", script.sha, len(keys), *keys, *args)

    def _pipelined(self, script: Any, keys: Sequence[str], shared: tuple[Any, ...],
                   per_key: Sequence[tuple[Any, ...]]) -> list[Any]:
        """``script`` once per key, all in one pipeline (one round trip).

        Every script here can run twice with the same arguments and give the same
        answer, so a pipeline that met a flushed script cache is simply sent again.
        """
        for _ in range(2):
            pipe = self.client.pipeline(transaction=False)
            for key, extra in zip(keys, per_key, strict=True):
                pipe.evalsha(script.sha, 1, key.encode("utf-8"), *shared, *extra)
            answers = pipe.execute(raise_on_error=False)
            if not any(isinstance(a, self._no_script) for a in answers):
                break
            script.sha = self.client.script_load(script.script)
        for answer in answers:
            if isinstance(answer, BaseException):
                raise answer
        return [answer[0] for answer in answers]

    # -- maintenance ----------------------------------------------------------------------

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
