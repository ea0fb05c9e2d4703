"""Broker adapters. ``InMemoryBroker`` needs nothing; the others load their client
library on first use (extras ``[redis]``, ``[rabbitmq]``, ``[kafka]``)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from msgpatterns.brokers.base import Broker, SupportsVirtualTime
from msgpatterns.brokers.memory import InMemoryBroker, VirtualClock

if TYPE_CHECKING:
    from msgpatterns.brokers.kafka import KafkaBroker
    from msgpatterns.brokers.rabbitmq import RabbitMQBroker
    from msgpatterns.brokers.redis_streams import RedisStreamsBroker

__all__ = [
    "Broker",
    "InMemoryBroker",
    "KafkaBroker",
    "RabbitMQBroker",
    "RedisStreamsBroker",
    "SupportsVirtualTime",
    "VirtualClock",
]

_LAZY = {
    "RedisStreamsBroker": "msgpatterns.brokers.redis_streams",
    "RabbitMQBroker": "msgpatterns.brokers.rabbitmq",
    "KafkaBroker": "msgpatterns.brokers.kafka",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'msgpatterns.brokers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
