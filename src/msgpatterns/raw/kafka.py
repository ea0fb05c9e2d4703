"""Moved to :mod:`msgpatterns.brokers.kafka.raw`; this module re-exports it so that old imports
work."""

from __future__ import annotations

from msgpatterns.brokers.kafka.raw import KafkaLoop

__all__ = ["KafkaLoop"]
