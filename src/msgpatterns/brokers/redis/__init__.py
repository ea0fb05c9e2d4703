"""Redis Streams: the sync adapter, the asyncio adapter, the dead-letter admin and the
raw-loop helper, one module each (``broker``, ``aio``, ``admin``, ``raw``).

Names load on first use (they need the ``[redis]`` extra)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgpatterns._extras import lazy_attributes

if TYPE_CHECKING:
    from msgpatterns.brokers.redis._link import redis_error
    from msgpatterns.brokers.redis.admin import RedisStreamsDeadLetters
    from msgpatterns.brokers.redis.aio import AsyncRedisStreamsBroker
    from msgpatterns.brokers.redis.broker import RedisStreamsBroker
    from msgpatterns.brokers.redis.raw import RedisLoop

__all__ = ["AsyncRedisStreamsBroker", "RedisLoop", "RedisStreamsBroker",
           "RedisStreamsDeadLetters", "redis_error"]

__getattr__ = lazy_attributes(__name__, {
    "RedisStreamsBroker": "msgpatterns.brokers.redis.broker",
    "AsyncRedisStreamsBroker": "msgpatterns.brokers.redis.aio",
    "RedisStreamsDeadLetters": "msgpatterns.brokers.redis.admin",
    "RedisLoop": "msgpatterns.brokers.redis.raw",
    "redis_error": "msgpatterns.brokers.redis._link",
})
