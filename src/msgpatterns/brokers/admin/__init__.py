"""Dead-letter admin: one :class:`DeadLetterAdmin` protocol, one class per broker.

Every adapter hands out its admin with ``broker.dead_letter_admin()`` (the async
adapters too: the wire format is shared, so one admin reads what sync and async
consumers dead-lettered). ``msgpatterns dlq`` drives the protocol and nothing else.

* ``InMemoryBroker``: :class:`~.memory.InMemoryDeadLetters`
* ``RedisStreamsBroker``: :class:`~.redis_streams.RedisStreamsDeadLetters`
* ``RabbitMQBroker``: :class:`~.rabbitmq.RabbitMQDeadLetters`
* ``KafkaBroker``: :class:`~.kafka.KafkaDeadLetters`
* ``NatsJetStreamBroker``: :class:`~.nats_jetstream.NatsJetStreamDeadLetters`
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
    from msgpatterns.brokers.admin.kafka import KafkaDeadLetters
    from msgpatterns.brokers.admin.memory import InMemoryDeadLetters
    from msgpatterns.brokers.admin.nats_jetstream import NatsJetStreamDeadLetters
    from msgpatterns.brokers.admin.rabbitmq import RabbitMQDeadLetters
    from msgpatterns.brokers.admin.redis_streams import RedisStreamsDeadLetters

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
    "InMemoryDeadLetters": "msgpatterns.brokers.admin.memory",
    "RedisStreamsDeadLetters": "msgpatterns.brokers.admin.redis_streams",
    "RabbitMQDeadLetters": "msgpatterns.brokers.admin.rabbitmq",
    "KafkaDeadLetters": "msgpatterns.brokers.admin.kafka",
    "NatsJetStreamDeadLetters": "msgpatterns.brokers.admin.nats_jetstream",
})
