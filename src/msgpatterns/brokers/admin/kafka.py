"""Moved to :mod:`msgpatterns.brokers.kafka.admin`; this module re-exports it so that old imports
work."""

from __future__ import annotations

from msgpatterns.brokers.kafka.admin import KafkaDeadLetters

__all__ = ["KafkaDeadLetters"]
