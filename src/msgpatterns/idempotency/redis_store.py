"""RedisChecker: the idempotency state machine on Redis (redis-py, fakeredis).

Each key is one Redis string whose value is the state (``P`` or ``D``), the 32-hex
owner token and the optional payload fingerprint. Every write sets an expiry: the
lease for PROCESSING, ``ttl`` for DONE, so no key ever lives forever and an expired
lease simply frees the key. Claim, complete and release are Lua scripts run by
``EVALSHA`` (keys and values travel as script KEYS and ARGV, never as syntax); the
batch calls send one pipeline, one round trip.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from msgpatterns._extras import require
from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency.base import ClaimRequest, LeaseChecker
from msgpatterns.idempotency.policy import StorePolicy
from msgpatterns.idempotency.records import PROCESSING, Record
from msgpatterns.idempotency.spec import CheckerSpec, policy_options

if TYPE_CHECKING:
    import redis

__all__ = ["RedisChecker"]

# KEYS[1] key; ARGV[1] "P" .. token .. fingerprint; ARGV[2] lease in ms.
# Returns 1 when claimed, else {current value, its remaining ms}.
CLAIM = """
local v = redis.call('GET', KEYS[1])
if v then return {v, redis.call('PTTL', KEYS[1])} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS[1] key; ARGV[1] token; ARGV[2] ttl in ms; ARGV[3] fingerprint.
# 1 when the key is (now) DONE by token: also when its lease expired and nobody took it.
COMPLETE = """
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('SET', KEYS[1], 'D' .. ARGV[1] .. ARGV[3], 'PX', ARGV[2])
  return 1
end
if string.sub(v, 2, 33) ~= ARGV[1] then return 0 end
if string.sub(v, 1, 1) == 'P' then
  redis.call('SET', KEYS[1], 'D' .. string.sub(v, 2), 'PX', ARGV[2])
end
return 1
"""

# KEYS[1] key; ARGV[1] token. Deletes a PROCESSING key held by token.
RELEASE = """
local v = redis.call('GET', KEYS[1])
if v and string.sub(v, 1, 33) == 'P' .. ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_CHUNK = 1000


def _text(value: Any) -> str:
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


def _record(reply: Any, request: ClaimRequest, lease_ms: int) -> Record:
    """The record a claim reply describes: 1 (claimed) or [current value, its PTTL]."""
    if reply == 1:
        return Record(PROCESSING, request.token, request.fingerprint, lease_ms / 1000)
    value, pttl = _text(reply[0]), int(reply[1])
    return Record(value[0], value[1:33], value[33:] or None, max(pttl, 0) / 1000)


#: Attempts of a single claim when the key vanishes between SET NX and the read-back.
_CLAIM_ATTEMPTS = 3


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
        client_or_url: a ``redis.Redis`` (or fakeredis) client, or a URL. A checker
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

    def __init__(
        self,
        client_or_url: redis.Redis | str,
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
        if isinstance(client_or_url, str):
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            self.url: str | None = client_or_url
            self.client: redis.Redis = redis_module.Redis.from_url(
                client_or_url, retry=Retry(NoBackoff(), 0), socket_connect_timeout=2.0,
                socket_timeout=5.0,
            )
            self._owns_client = True
        else:
            self.url = None
            self.client = client_or_url
            self._owns_client = False
        self._lease_ms = max(1, int(self.lease * 1000))
        self._ttl_ms = max(1, int(self.ttl * 1000))
        self._claim_script = self.client.register_script(CLAIM)
        self._complete_script = self.client.register_script(COMPLETE)
        self._release_script = self.client.register_script(RELEASE)

    # -- I/O ----------------------------------------------------------------------------

    def _eval(self, script: Any, key: str, *args: Any) -> Any:
        """One script call (re-loading the script if the server lost it)."""
        try:
            return self.client.evalsha(script.sha, 1, key.encode("utf-8"), *args)
        except self._no_script:
            script.sha = self.client.script_load(script.script)
            return self.client.evalsha(script.sha, 1, key.encode("utf-8"), *args)

    def _claim_record(self, request: ClaimRequest) -> Record:
        """``SET NX PX`` (one round trip, like a hand-written claim); only when the key
        exists, a second round trip reads what holds it."""
        key = request.key.encode("utf-8")
        value = "P" + request.token + (request.fingerprint or "")
        for _ in range(_CLAIM_ATTEMPTS):
            if self.client.set(key, value, nx=True, px=self._lease_ms):
                return _record(1, request, self._lease_ms)
            pipe = self.client.pipeline(transaction=False)
            pipe.get(key)
            pipe.pttl(key)
            current, pttl = pipe.execute()
            if current is not None:
                return _record((current, pttl), request, self._lease_ms)
        # the key keeps vanishing under us (very short leases): report it as busy
        return Record(PROCESSING, "", None, 0.0)

    def _claim_records(self, requests: Sequence[ClaimRequest]) -> list[Record]:
        replies = self._pipelined(self._claim_script, [
            (r.key, ("P" + r.token + (r.fingerprint or ""), self._lease_ms)) for r in requests
        ])
        return [_record(reply, request, self._lease_ms)
                for reply, request in zip(replies, requests, strict=True)]

    def _complete_record(self, item: ClaimRequest) -> bool:
        return bool(self._eval(self._complete_script, item.key, item.token, self._ttl_ms,
                               item.fingerprint or ""))

    def _complete_records(self, items: Sequence[ClaimRequest]) -> list[bool]:
        replies = self._pipelined(self._complete_script, [
            (key, (token, self._ttl_ms, fingerprint or "")) for key, token, fingerprint in items
        ])
        return [bool(reply) for reply in replies]

    def _release_records(self, items: Sequence[ClaimRequest]) -> list[bool]:
        if len(items) == 1:
            return [bool(self._eval(self._release_script, items[0].key, items[0].token))]
        replies = self._pipelined(self._release_script,
                                  [(key, (token,)) for key, token, _ in items])
        return [bool(reply) for reply in replies]

    def _pipelined(self, script: Any, calls: Sequence[tuple[str, tuple[Any, ...]]]) -> list[Any]:
        """Run ``script`` once per (key, args) in pipelines of up to 1000 calls.

        Every script here can run twice with the same arguments and give the same
        answer, so a pipeline that met a flushed script cache is simply sent again.
        """
        replies: list[Any] = []
        for start in range(0, len(calls), _CHUNK):
            chunk = calls[start:start + _CHUNK]
            for _ in range(2):
                pipe = self.client.pipeline(transaction=False)
                for key, args in chunk:
                    pipe.evalsha(script.sha, 1, key.encode("utf-8"), *args)
                answers = pipe.execute(raise_on_error=False)
                if not any(isinstance(a, self._no_script) for a in answers):
                    break
                script.sha = self.client.script_load(script.script)
            for answer in answers:
                if isinstance(answer, BaseException):
                    raise answer
            replies.extend(answers)
        return replies

    # -- maintenance ----------------------------------------------------------------------

    def purge(self, older_than: float | timedelta | None = None) -> int:
        """Nothing to do: Redis expires every key itself. Returns 0."""
        return 0

    def spec(self) -> CheckerSpec:
        """The URL and options that rebuild this checker in another process."""
        return CheckerSpec("redis", self.url or _url_of(self.client), {
            "namespace": self.namespace, "ttl": self.ttl, "lease": self.lease,
            "max_key_bytes": self.keys.max_bytes, "policy": policy_options(self.policy),
            "write_behind": self.write_behind,
        })

    def _close(self) -> None:
        if self._owns_client:
            self.client.close()
