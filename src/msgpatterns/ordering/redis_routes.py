"""RedisRouteStore: an ordered topic's routes, leases and command records in Redis.

All keys of a topic share the hash tag ``{<topic>}`` (one Redis Cluster slot). Every
change of version, every lease change and reading a consistent state is one Lua
script, so a version has one winner and a lease one owner. Leases and members expire
on the caller's clock (the values passed as ``now``), like the other stores.

Needs the ``[redis]`` extra (redis-py).
"""

from __future__ import annotations

from typing import Any

from msgpatterns._extras import require
from msgpatterns._redact import redact_url
from msgpatterns.ordering.route_store import TopicState, may_propose
from msgpatterns.ordering.routes import Route

__all__ = ["RedisRouteStore"]

_STATE = """
local v = redis.call('HGET', KEYS[1], 'version')
if not v then return nil end
return {redis.call('HGET', KEYS[2], v), redis.call('HGET', KEYS[1], 'pending') or false}
"""
_CREATE = """
if redis.call('HSETNX', KEYS[1], 'version', ARGV[1]) == 1 then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
end
return redis.call('HGET', KEYS[2], redis.call('HGET', KEYS[1], 'version'))
"""
_PROPOSE = """
if redis.call('HGET', KEYS[1], 'version') ~= ARGV[1] then return 0 end
if redis.call('HEXISTS', KEYS[1], 'pending_version') == 1 then return 0 end
redis.call('HSET', KEYS[1], 'pending_version', ARGV[2], 'pending', ARGV[3])
return 1
"""
_COMMIT = """
if redis.call('HGET', KEYS[1], 'pending_version') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], redis.call('HGET', KEYS[1], 'pending'))
redis.call('HSET', KEYS[1], 'version', ARGV[1])
redis.call('HDEL', KEYS[1], 'pending_version', 'pending')
return 1
"""
# A lease value is "<expires>|<owner>" (the owner may hold any character).
_LEASE = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  local bar = string.find(cur, '|', 1, true)
  local expires = tonumber(string.sub(cur, 1, bar - 1))
  if string.sub(cur, bar + 1) ~= ARGV[2] and expires > tonumber(ARGV[3]) then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[4] .. '|' .. ARGV[2])
return 1
"""
_RELEASE = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and string.sub(cur, string.find(cur, '|', 1, true) + 1) == ARGV[2] then
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return 1
"""


class RedisRouteStore:
    """A :class:`~msgpatterns.ordering.RouteStore` on Redis.

    Args:
        client_or_url: a ``redis.Redis`` client (or fakeredis) or a ``redis://`` /
            ``rediss://`` URL (the store then owns the client and closes it).
        prefix: the keys' prefix (``msgpatterns:route`` by default).
    """

    def __init__(self, client_or_url: Any, *, prefix: str = "msgpatterns:route") -> None:
        require("redis", "redis")
        import redis

        self._owns = isinstance(client_or_url, str)
        self._url = redact_url(client_or_url) if self._owns else repr(client_or_url)
        self.client: Any = (redis.Redis.from_url(client_or_url) if self._owns
                            else client_or_url)
        self.prefix = prefix
        self._state = self.client.register_script(_STATE)
        self._create = self.client.register_script(_CREATE)
        self._propose = self.client.register_script(_PROPOSE)
        self._commit = self.client.register_script(_COMMIT)
        self._lease = self.client.register_script(_LEASE)
        self._release = self.client.register_script(_RELEASE)

    def _key(self, topic: str, *parts: str) -> str:
        return ":".join((self.prefix, "{" + topic + "}", *parts))

    def _topic_keys(self, topic: str) -> list[str]:
        return [self._key(topic, "state"), self._key(topic, "history")]

    # -- routes ---------------------------------------------------------------------

    def create(self, topic: str, route: Route) -> Route:
        text = self._create(keys=self._topic_keys(topic),
                            args=[route.version, route.to_json()])
        return Route.from_json(text)

    def state(self, topic: str) -> TopicState | None:
        reply = self._state(keys=self._topic_keys(topic))
        if reply is None:
            return None
        committed, pending = reply
        return TopicState(Route.from_json(committed),
                          Route.from_json(pending) if pending else None)

    def history(self, topic: str) -> list[Route]:
        stored = self.client.hgetall(self._key(topic, "history"))
        return [Route.from_json(stored[v]) for v in sorted(stored, key=int)]

    def propose(self, topic: str, route: Route) -> bool:
        if not may_propose(self.state(topic), route):
            return False
        return bool(self._propose(keys=self._topic_keys(topic),
                                  args=[route.version - 1, route.version, route.to_json()]))

    def commit(self, topic: str, version: int) -> bool:
        return bool(self._commit(keys=self._topic_keys(topic), args=[version]))

    # -- consumers ------------------------------------------------------------------

    def record_command(self, topic: str, group: str, version: int, physical: int) -> None:
        self.client.sadd(self._key(topic, "commands", group), f"{version}:{physical}")

    def commands(self, topic: str, group: str) -> frozenset[tuple[int, int]]:
        out: set[tuple[int, int]] = set()
        for item in self.client.smembers(self._key(topic, "commands", group)):
            version, physical = (item.decode() if isinstance(item, bytes) else item).split(":")
            out.add((int(version), int(physical)))
        return frozenset(out)

    def lease(self, topic: str, group: str, physical: int, owner: str, now: float,
              ttl: float) -> bool:
        return bool(self._lease(keys=[self._key(topic, "leases", group)],
                                args=[physical, owner, repr(now), repr(now + ttl)]))

    def release(self, topic: str, group: str, physical: int, owner: str) -> None:
        self._release(keys=[self._key(topic, "leases", group)], args=[physical, owner])

    def leases(self, topic: str, group: str, now: float) -> dict[int, str]:
        return self._leases(topic, group, now, live=True)

    def expired_leases(self, topic: str, group: str, now: float) -> dict[int, str]:
        return self._leases(topic, group, now, live=False)

    def _leases(self, topic: str, group: str, now: float, *, live: bool) -> dict[int, str]:
        out: dict[int, str] = {}
        for physical, value in self.client.hgetall(self._key(topic, "leases", group)).items():
            text = value.decode() if isinstance(value, bytes) else value
            expires, _, owner = text.partition("|")
            if (float(expires) > now) == live:
                out[int(physical)] = owner
        return out

    def heartbeat(self, topic: str, group: str, owner: str, now: float, ttl: float) -> None:
        self.client.zadd(self._key(topic, "members", group), {owner: now + ttl})

    def leave(self, topic: str, group: str, owner: str) -> None:
        self.client.zrem(self._key(topic, "members", group), owner)

    def members(self, topic: str, group: str, now: float) -> list[str]:
        live = self.client.zrangebyscore(self._key(topic, "members", group),
                                         f"({now!r}", "+inf")
        return sorted(m.decode() if isinstance(m, bytes) else m for m in live)

    def close(self) -> None:
        """Close the client when the store built it from a URL."""
        if self._owns:
            self.client.close()

    def __repr__(self) -> str:
        return f"RedisRouteStore({self._url})"
