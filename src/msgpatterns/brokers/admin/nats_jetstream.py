"""Moved to :mod:`msgpatterns.brokers.nats.admin`; this module re-exports it so that old imports
work."""

from __future__ import annotations

from msgpatterns.brokers.nats.admin import NatsJetStreamDeadLetters

__all__ = ["NatsJetStreamDeadLetters"]
