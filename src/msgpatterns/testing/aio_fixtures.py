"""pytest fixtures for ``async def`` handlers (registered by the msgpatterns plugin).

* ``async_fake_broker`` - a fresh :class:`~msgpatterns.aio.AsyncInMemoryBroker` with the
  same options and fault injection as ``fake_broker``: seed 0 and no faults unless the
  test carries ``@pytest.mark.msgpatterns(duplicate_rate=..., reorder_window=...,
  lost_ack_rate=..., visibility_timeout=..., seed=...)``.
* ``aconsume`` - ``await aconsume(handler, topic="test", group="test", **kwargs)`` runs
  an :class:`~msgpatterns.aio.AsyncConsumer` on ``async_fake_broker`` until idle
  (virtual time) and returns it.

The fixtures themselves are plain (not async): they work under pytest-asyncio and
anyio alike; only the test using them is ``async def``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from msgpatterns.aio.consumer import AsyncConsumer
from msgpatterns.brokers.memory.aio import AsyncInMemoryBroker
from msgpatterns.message import Message
from msgpatterns.testing._markers import fake_broker_options

__all__ = ["AConsumeFn", "aconsume", "async_fake_broker"]

AConsumeFn = Callable[..., Awaitable[AsyncConsumer]]


@pytest.fixture
def async_fake_broker(request: pytest.FixtureRequest) -> Iterator[AsyncInMemoryBroker]:
    """An async in-memory broker with at-least-once semantics and the faults asked for
    by ``@pytest.mark.msgpatterns(...)`` (none by default)."""
    broker = AsyncInMemoryBroker(**fake_broker_options(request))
    yield broker
    broker.sync.close()


@pytest.fixture
def aconsume(async_fake_broker: AsyncInMemoryBroker) -> AConsumeFn:
    """Run an ``async def`` handler over ``async_fake_broker`` until nothing is left."""

    async def run(
        handler: Callable[[Message], Awaitable[Any]],
        topic: str | list[str] = "test",
        group: str = "test",
        timeout: float = 60.0,
        **kwargs: Any,
    ) -> AsyncConsumer:
        topics = [topic] if isinstance(topic, str) else topic
        consumer = AsyncConsumer(async_fake_broker, handler, topics=topics, group=group,
                                 **kwargs)
        await consumer.run_until_idle(timeout=timeout)
        return consumer

    return run
