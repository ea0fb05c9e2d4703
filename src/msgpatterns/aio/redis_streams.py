"""Moved to :mod:`msgpatterns.brokers.redis.aio`; this module re-exports it so that old imports
work."""

from __future__ import annotations

from msgpatterns.brokers.redis.aio import AsyncRedisStreamsBroker

__all__ = ["AsyncRedisStreamsBroker"]
