"""Moved to :mod:`msgpatterns._redispy` (every use of redis-py's internals is there);
this module re-exports the links so that old imports work."""

from __future__ import annotations

from msgpatterns._redispy import AsyncRedisLink, RedisLink

__all__ = ["AsyncRedisLink", "RedisLink"]
