"""Moved to :mod:`msgpatterns.brokers.redis.raw`; this module re-exports it so that old imports
work."""

from __future__ import annotations

from msgpatterns.brokers.redis.raw import RedisLoop

__all__ = ["RedisLoop"]
