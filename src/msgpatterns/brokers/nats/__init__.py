"""NATS JetStream: the sync adapter and the dead-letter admin, one module each
(``broker``, ``admin``).

Names load on first use (they need the ``[nats]`` extra)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgpatterns._extras import lazy_attributes

if TYPE_CHECKING:
    from msgpatterns.brokers.nats.admin import NatsJetStreamDeadLetters
    from msgpatterns.brokers.nats.broker import NatsJetStreamBroker

__all__ = ["NatsJetStreamBroker", "NatsJetStreamDeadLetters"]

__getattr__ = lazy_attributes(__name__, {
    "NatsJetStreamBroker": "msgpatterns.brokers.nats.broker",
    "NatsJetStreamDeadLetters": "msgpatterns.brokers.nats.admin",
})
