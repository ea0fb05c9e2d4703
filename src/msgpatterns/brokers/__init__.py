"""Broker adapters. ``InMemoryBroker`` needs nothing; the others load their client
library on first use (extras ``[redis]``, ``[rabbitmq]``, ``[kafka]``, ``[nats]``).

Each broker is a package of its own (``msgpatterns.brokers.redis``, ``.rabbitmq``,
``.kafka``, ``.nats``, ``.memory``: the wire core, the sync and asyncio adapters, the
dead-letter admin, the raw loop); what they share lives here (``codec``, ``base``,
``admin.base``, ``loop``, ``threaded``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgpatterns._extras import lazy_attributes
from msgpatterns.brokers._batch import Outgoing, PartialPublish
from msgpatterns.brokers.admin import DeadLetterAdmin
from msgpatterns.brokers.base import Broker, SupportsVirtualTime
from msgpatterns.brokers.memory.broker import InMemoryBroker, VirtualClock

if TYPE_CHECKING:
    from msgpatterns.brokers.kafka.broker import KafkaBroker
    from msgpatterns.brokers.nats.broker import NatsJetStreamBroker
    from msgpatterns.brokers.rabbitmq.broker import RabbitMQBroker
    from msgpatterns.brokers.redis.broker import RedisStreamsBroker

__all__ = [
    "Broker",
    "DeadLetterAdmin",
    "InMemoryBroker",
    "KafkaBroker",
    "NatsJetStreamBroker",
    "Outgoing",
    "PartialPublish",
    "RabbitMQBroker",
    "RedisStreamsBroker",
    "SupportsVirtualTime",
    "VirtualClock",
]

_LAZY = {
    "RedisStreamsBroker": "msgpatterns.brokers.redis.broker",
    "RabbitMQBroker": "msgpatterns.brokers.rabbitmq.broker",
    "KafkaBroker": "msgpatterns.brokers.kafka.broker",
    "NatsJetStreamBroker": "msgpatterns.brokers.nats.broker",
}


__getattr__ = lazy_attributes(__name__, _LAZY)
