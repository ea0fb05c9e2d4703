"""Dead-letter admin: one :class:`DeadLetterAdmin` protocol, one class per broker.

Every adapter hands out its admin with ``broker.dead_letter_admin()`` (the async
adapters too: the wire format is shared, so one admin reads what sync and async
consumers dead-lettered). ``msgpatterns dlq`` drives the protocol and nothing else.

* ``InMemoryBroker``: :class:`~msgpatterns.brokers.memory.admin.InMemoryDeadLetters`
* ``RedisStreamsBroker``: :class:`~msgpatterns.brokers.redis.admin.RedisStreamsDeadLetters`
* ``RabbitMQBroker``: :class:`~msgpatterns.brokers.rabbitmq.admin.RabbitMQDeadLetters`
* ``KafkaBroker``: :class:`~msgpatterns.brokers.kafka.admin.KafkaDeadLetters`
* ``NatsJetStreamBroker``: :class:`~msgpatterns.brokers.nats.admin.NatsJetStreamDeadLetters`

Each lives in its broker's package (``msgpatterns.brokers.<broker>.admin``); the
modules ``msgpatterns.brokers.admin.<broker>`` re-export them. :mod:`.base` holds what
they share.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgpatterns._extras import lazy_attributes
from msgpatterns.brokers.admin.base import (
    DeadLetterAdmin,
    ScannedDeadLetters,
    replay_owner,
    selected,
)

if TYPE_CHECKING:
    from msgpatterns.brokers.kafka.admin import KafkaDeadLetters
    from msgpatterns.brokers.memory.admin import InMemoryDeadLetters
    from msgpatterns.brokers.nats.admin import NatsJetStreamDeadLetters
    from msgpatterns.brokers.rabbitmq.admin import RabbitMQDeadLetters
    from msgpatterns.brokers.redis.admin import RedisStreamsDeadLetters

__all__ = [
    "DeadLetterAdmin",
    "InMemoryDeadLetters",
    "KafkaDeadLetters",
    "NatsJetStreamDeadLetters",
    "RabbitMQDeadLetters",
    "RedisStreamsDeadLetters",
    "ScannedDeadLetters",
    "replay_owner",
    "selected",
]

__getattr__ = lazy_attributes(__name__, {
    "InMemoryDeadLetters": "msgpatterns.brokers.memory.admin",
    "RedisStreamsDeadLetters": "msgpatterns.brokers.redis.admin",
    "RabbitMQDeadLetters": "msgpatterns.brokers.rabbitmq.admin",
    "KafkaDeadLetters": "msgpatterns.brokers.kafka.admin",
    "NatsJetStreamDeadLetters": "msgpatterns.brokers.nats.admin",
})
