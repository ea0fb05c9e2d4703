"""AsyncInMemoryBroker: the :class:`~msgpatterns.brokers.memory.broker.InMemoryBroker` seen
through the :class:`~msgpatterns.aio.base.AsyncBroker` protocol.

It wraps (never copies) an ``InMemoryBroker``: the same at-least-once semantics, the
same virtual clock, the same fault injection, and the same state, so a sync
:class:`~msgpatterns.Consumer` and an :class:`~msgpatterns.aio.AsyncConsumer` on one
fake share its messages, retries and dead letters. Operations that cannot wait run
inline (they only take the fake's lock); a fetch that finds nothing waits for new
messages in a worker thread (``asyncio.to_thread``), so the event loop never blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from msgpatterns.brokers._adapter import topic_list
from msgpatterns.brokers.admin.base import DeadLetterAdmin
from msgpatterns.brokers.memory.broker import BrokerEvent, BrokerStats, InMemoryBroker, VirtualClock
from msgpatterns.deadletter import DeadLetter
from msgpatterns.errors import ConfigurationError
from msgpatterns.message import Message

__all__ = ["AsyncInMemoryBroker"]


class AsyncInMemoryBroker:
    """The async face of an :class:`~msgpatterns.InMemoryBroker`.

    Args:
        broker: the fake to share (e.g. with a sync Consumer); default: a new one built
            from ``options`` (``seed``, ``duplicate_rate``, ``reorder_window``,
            ``lost_ack_rate``, ``visibility_timeout``, ``clock``, ``record_history``).

    :attr:`sync` is the wrapped fake (for assertions and sync publishers); ``acked``,
    ``dead_letters``, ``pending``, ``stats``, ``history`` and ``clock`` are its views.
    """

    def __init__(self, broker: InMemoryBroker | None = None, **options: Any) -> None:
        if broker is not None and options:
            raise ConfigurationError("pass either an InMemoryBroker or its options, not both")
        self.sync = broker if broker is not None else InMemoryBroker(**options)

    # -- AsyncBroker protocol ---------------------------------------------------------

    def now(self) -> float:
        return self.sync.now()

    async def publish(self, topic: str, body: Any, *, key: str | None = None,
                      headers: Mapping[str, str] | None = None,
                      id: str | None = None) -> str:
        """Publish to every group of ``topic``; returns the message id."""
        return self.sync.publish(topic, body, key=key, headers=headers, id=id)

    async def publish_many(self, topic: str, items: Iterable[Any]) -> list[str]:
        """All or nothing, as :meth:`InMemoryBroker.publish_many`."""
        return self.sync.publish_many(topic, items)

    async def subscribe(self, topic: str, group: str) -> None:
        self.sync.subscribe(topic, group)

    async def fetch(self, topics: Sequence[str], group: str, max_messages: int = 1,
                    timeout: float = 0.0) -> list[Message]:
        """Up to ``max_messages`` deliveries; waits up to ``timeout`` seconds (in a
        worker thread) only when none is ready now."""
        topics = topic_list(topics)
        ready = self.sync.fetch(topics, group, max_messages, 0.0)
        if ready or timeout <= 0:
            return ready
        return await asyncio.to_thread(self.sync.fetch, topics, group, max_messages, timeout)

    async def ack(self, message: Message) -> None:
        self.sync.ack(message)

    async def nack(self, message: Message, delay: float = 0.0) -> None:
        self.sync.nack(message, delay)

    async def dead_letter(self, message: Message, record: DeadLetter) -> None:
        self.sync.dead_letter(message, record)

    async def close(self) -> None:
        """Close the fake (:meth:`InMemoryBroker.close
        <msgpatterns.InMemoryBroker.close>`); idempotent."""
        self.sync.close()

    async def aclose(self) -> None:
        """:meth:`close`, under the name every async part of msgpatterns has."""
        self.sync.close()

    async def __aenter__(self) -> AsyncInMemoryBroker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- virtual time (SupportsVirtualTime) -------------------------------------------

    def next_due(self, topics: Sequence[str], group: str) -> float | None:
        return self.sync.next_due(topics, group)

    def advance_to(self, when: float) -> None:
        self.sync.advance_to(when)

    def advance(self, seconds: float) -> None:
        self.sync.advance(seconds)

    # -- assertion views ----------------------------------------------------------------

    @property
    def clock(self) -> VirtualClock:
        return self.sync.clock

    @property
    def acked(self) -> list[Message]:
        return self.sync.acked

    @property
    def dead_letters(self) -> list[DeadLetter]:
        return self.sync.dead_letters

    @property
    def pending(self) -> int:
        return self.sync.pending

    @property
    def stats(self) -> BrokerStats:
        return self.sync.stats

    @property
    def history(self) -> list[BrokerEvent]:
        return self.sync.history

    @property
    def closed(self) -> bool:
        return self.sync.closed

    def dead_letter_admin(self) -> DeadLetterAdmin:
        """The fake's dead-letter admin (see :meth:`InMemoryBroker.dead_letter_admin`)."""
        return self.sync.dead_letter_admin()

    def list_dead_letters(self, topic: str, group: str | None = None, *,
                          limit: int | None = None) -> list[DeadLetter]:
        """Dead letters of ``topic`` (of ``group``, or all groups)."""
        return self.sync.list_dead_letters(topic, group, limit=limit)
