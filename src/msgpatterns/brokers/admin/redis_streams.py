"""Moved to :mod:`msgpatterns.brokers.redis.admin`; this module re-exports it so that old imports
work."""

from __future__ import annotations

from msgpatterns.brokers.redis.admin import RedisStreamsDeadLetters

__all__ = ["RedisStreamsDeadLetters"]
