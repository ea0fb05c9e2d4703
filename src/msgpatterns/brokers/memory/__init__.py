"""The in-memory fake: the sync broker, its asyncio face and its dead-letter admin, one
module each (``broker``, ``aio``, ``admin``). This package is also the former module
``msgpatterns.brokers.memory``: its names still import from here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgpatterns._extras import lazy_attributes

if TYPE_CHECKING:
    from msgpatterns.brokers.memory.admin import InMemoryDeadLetters
    from msgpatterns.brokers.memory.aio import AsyncInMemoryBroker
    from msgpatterns.brokers.memory.broker import (
        BrokerEvent,
        BrokerStats,
        InMemoryBroker,
        VirtualClock,
    )

__all__ = ["AsyncInMemoryBroker", "BrokerEvent", "BrokerStats", "InMemoryBroker",
           "InMemoryDeadLetters", "VirtualClock"]

__getattr__ = lazy_attributes(__name__, {
    "InMemoryBroker": "msgpatterns.brokers.memory.broker",
    "VirtualClock": "msgpatterns.brokers.memory.broker",
    "BrokerEvent": "msgpatterns.brokers.memory.broker",
    "BrokerStats": "msgpatterns.brokers.memory.broker",
    "AsyncInMemoryBroker": "msgpatterns.brokers.memory.aio",
    "InMemoryDeadLetters": "msgpatterns.brokers.memory.admin",
})
