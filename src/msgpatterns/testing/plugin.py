"""pytest plugin: fixtures for testing handlers without a real broker.

Registered through the ``pytest11`` entry point. Fixtures:

* ``fake_broker`` - a fresh :class:`~msgpatterns.InMemoryBroker` (seed 0, no faults).
* ``consume`` - ``consume(handler, topic="test", group="test", **consumer_kwargs)`` runs a
  :class:`~msgpatterns.Consumer` on ``fake_broker`` until idle and returns it.
* ``effects`` - an :class:`~msgpatterns.testing.EffectLog`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from msgpatterns.brokers.memory import InMemoryBroker
from msgpatterns.consumer import Consumer
from msgpatterns.message import Message
from msgpatterns.testing.assertions import EffectLog
from msgpatterns.testing.checker_fixtures import memory_checker, redis_checker, sql_checker  # noqa: F401

ConsumeFn = Callable[..., Consumer]


@pytest.fixture
def fake_broker() -> Iterator[InMemoryBroker]:
    """An in-memory broker with at-least-once semantics and no injected faults."""
    broker = InMemoryBroker(seed=0)
    yield broker
    broker.close()


@pytest.fixture
def consume(fake_broker: InMemoryBroker) -> ConsumeFn:
    """Run a handler over ``fake_broker`` until nothing is left to do."""

    def run(
        handler: Callable[[Message], Any],
        topic: str | list[str] = "test",
        group: str = "test",
        timeout: float = 60.0,
        **kwargs: Any,
    ) -> Consumer:
        topics = [topic] if isinstance(topic, str) else topic
        consumer = Consumer(fake_broker, handler, topics=topics, group=group, **kwargs)
        consumer.run_until_idle(timeout=timeout)
        return consumer

    return run


@pytest.fixture
def effects() -> EffectLog:
    """Record business effects by key and assert each happened exactly once."""
    return EffectLog()
