"""Moved to :mod:`msgpatterns.brokers.memory.aio`; this module re-exports it so that old imports
work."""

from __future__ import annotations

from msgpatterns.brokers.memory.aio import AsyncInMemoryBroker

__all__ = ["AsyncInMemoryBroker"]
