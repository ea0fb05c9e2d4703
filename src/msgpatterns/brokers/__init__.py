"""Broker adapters. ``InMemoryBroker`` needs nothing; the others load their client
library on first use (extras ``[redis]``, ``[rabbitmq]``, ``[kafka]``, ``[nats]``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgpatterns._extras import lazy_attributes
from msgpatterns.brokers._batch import Outgoing, PartialPublish
from msgpatterns.brokers.admin import DeadLetterAdmin
from msgpatterns.brokers.base import Broker, SupportsVirtualTime
from msgpatterns.brokers.memory import InMemoryBroker, VirtualClock

if TYPE_CHECKING:
    from msgpatterns.brokers.kafka import KafkaBroker
    from msgpatterns.brokers.nats_jetstream import NatsJetStreamBroker
    from msgpatterns.brokers.rabbitmq import RabbitMQBroker
    from msgpatterns.brokers.redis_streams import RedisStreamsBroker

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
    "RedisStreamsBroker": "msgpatterns.brokers.redis_streams",
    "RabbitMQBroker": "msgpatterns.brokers.rabbitmq",
    "KafkaBroker": "msgpatterns.brokers.kafka",
    "NatsJetStreamBroker": "msgpatterns.brokers.nats_jetstream",
}


__getattr__ = lazy_attributes(__name__, _LAZY)
