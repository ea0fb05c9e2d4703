"""Moved to :mod:`msgpatterns.brokers.kafka.aio`; this module re-exports it so that old imports
work."""

from __future__ import annotations

from msgpatterns.brokers.kafka.aio import AIOKafkaBroker, AsyncKafkaBroker

__all__ = ["AIOKafkaBroker", "AsyncKafkaBroker"]
