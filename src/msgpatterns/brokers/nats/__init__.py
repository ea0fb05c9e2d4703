"""NATS JetStream: the sync adapter, the asyncio adapter and the dead-letter admin, one
module each (``broker``, ``aio``, ``admin``), over one wire core (``_wire``), one ack
ledger (``_acks``) and one JetStream session (``_session``) that both adapters run.

Names load on first use (they need the ``[nats]`` extra)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgpatterns._extras import lazy_attributes

if TYPE_CHECKING:
    from msgpatterns.brokers.nats.admin import NatsJetStreamDeadLetters
    from msgpatterns.brokers.nats.aio import AsyncNatsJetStreamBroker
    from msgpatterns.brokers.nats.broker import NatsJetStreamBroker

__all__ = ["AsyncNatsJetStreamBroker", "NatsJetStreamBroker", "NatsJetStreamDeadLetters"]

__getattr__ = lazy_attributes(__name__, {
    "NatsJetStreamBroker": "msgpatterns.brokers.nats.broker",
    "AsyncNatsJetStreamBroker": "msgpatterns.brokers.nats.aio",
    "NatsJetStreamDeadLetters": "msgpatterns.brokers.nats.admin",
})
