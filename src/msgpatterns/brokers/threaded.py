"""ThreadedAsyncBroker: any sync :class:`~msgpatterns.brokers.base.Broker` as an
:class:`~msgpatterns.aio.base.AsyncBroker`, each call run in a worker thread.

This is how confluent-kafka's own asyncio API works (its ``AIOConsumer`` and
``AIOProducer`` run the sync client in an executor): the adapter's logic - offsets,
retry topics, pausing, rebalances - exists once, in the sync adapter, and the event
loop never blocks on it. The sync adapter must be thread-safe (every adapter is: the
sync :class:`~msgpatterns.Consumer` calls it from several threads).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

from msgpatterns.brokers._aio_adapter import AsyncBrokerAdapter
from msgpatterns.brokers.admin.base import DeadLetterAdmin
from msgpatterns.brokers.base import Broker, SupportsWireBounds
from msgpatterns.deadletter import DeadLetter
from msgpatterns.headers import WireBounds
from msgpatterns.message import Message

__all__ = ["ThreadedAsyncBroker"]


class ThreadedAsyncBroker(AsyncBrokerAdapter):
    """The async face of the sync broker :attr:`sync` (every guarantee is its own);
    :meth:`dead_letter_admin` is the sync broker's admin."""

    def __init__(self, broker: Broker) -> None:
        self.sync = broker

    def now(self) -> float:
        return self.sync.now()

    async def _publish(self, topic: str, payload: bytes, key: str | None,
                       headers: Mapping[str, str]) -> str:
        return await asyncio.to_thread(self.sync.publish, topic, payload, key=key,
                                       headers=headers)

    @property
    def closed(self) -> bool:
        return bool(getattr(self.sync, "closed", False))

    def bound_wire(self, group: str, bounds: WireBounds) -> None:
        """Tell the sync broker too (it reads the deliveries)."""
        super().bound_wire(group, bounds)
        if isinstance(self.sync, SupportsWireBounds):
            self.sync.bound_wire(group, bounds)

    def dead_letter_admin(self) -> DeadLetterAdmin:
        """The sync broker's own admin (see :attr:`sync`)."""
        admin: DeadLetterAdmin = getattr(self.sync, "dead_letter_admin")()  # noqa: B009
        return admin

    async def publish_many(self, topic: str, items: Iterable[Any]) -> list[str]:
        publish_many = getattr(self.sync, "publish_many")  # noqa: B009 - not in the protocol
        result: list[str] = await asyncio.to_thread(publish_many, topic, list(items))
        return result

    async def subscribe(self, topic: str, group: str) -> None:
        subscribe = getattr(self.sync, "subscribe", None)
        if subscribe is not None:
            await asyncio.to_thread(subscribe, topic, group)

    async def _fetch_messages(self, topics: list[str], group: str, max_messages: int,
                             timeout: float) -> list[Message]:
        return await asyncio.to_thread(self.sync.fetch, topics, group,
                                       max_messages, timeout)

    async def ack(self, message: Message) -> None:
        await asyncio.to_thread(self.sync.ack, message)

    async def nack(self, message: Message, delay: float = 0.0) -> None:
        await asyncio.to_thread(self.sync.nack, message, delay)

    async def dead_letter(self, message: Message, record: DeadLetter) -> None:
        await asyncio.to_thread(self.sync.dead_letter, message, record)

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sync!r})"
