"""Moved to :mod:`msgpatterns.brokers.redis.broker`; this module re-exports it so that old imports
work."""

from __future__ import annotations

from msgpatterns.brokers.redis.broker import RedisStreamsBroker

__all__ = ["RedisStreamsBroker"]
