"""pytest plugin: fixtures for testing handlers without a real broker.

Registered through the ``pytest11`` entry point. Fixtures:

* ``fake_broker`` - a fresh :class:`~msgpatterns.InMemoryBroker` (seed 0, no faults
  unless the test carries ``@pytest.mark.msgpatterns(duplicate_rate=..., ...)``).
* ``consume`` - ``consume(handler, topic="test", group="test", **consumer_kwargs)`` runs a
  :class:`~msgpatterns.Consumer` on ``fake_broker`` until idle and returns it.
* ``effects`` - an :class:`~msgpatterns.testing.EffectLog`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from msgpatterns.brokers.memory.broker import InMemoryBroker
from msgpatterns.consumer import Consumer
from msgpatterns.message import Message
from msgpatterns.testing._markers import fake_broker_options
from msgpatterns.testing.aio_fixtures import aconsume, async_fake_broker  # noqa: F401
from msgpatterns.testing.assertions import EffectLog
from msgpatterns.testing.checker_fixtures import memory_checker, redis_checker, sql_checker  # noqa: F401

ConsumeFn = Callable[..., Consumer]



def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "msgpatterns(seed=0, duplicate_rate=0.0, reorder_window=0, lost_ack_rate=0.0, "
        "visibility_timeout=900.0): faults the fake_broker fixture injects",
    )


@pytest.fixture
def fake_broker(request: pytest.FixtureRequest) -> Iterator[InMemoryBroker]:
    """An in-memory broker with at-least-once semantics. No faults by default; a test
    (or module, with ``pytestmark``) asks for them with
    ``@pytest.mark.msgpatterns(duplicate_rate=0.3, reorder_window=8, lost_ack_rate=0.1,
    seed=1)``."""
    broker = InMemoryBroker(**fake_broker_options(request))
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
