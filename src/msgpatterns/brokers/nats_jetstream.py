"""Moved to :mod:`msgpatterns.brokers.nats.broker`; this module re-exports it so that old imports
work."""

from __future__ import annotations

from msgpatterns.brokers.nats.broker import NatsJetStreamBroker
from msgpatterns.brokers.nats.broker import nats as nats

__all__ = ["NatsJetStreamBroker"]
