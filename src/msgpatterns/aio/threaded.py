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
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from msgpatterns.brokers.base import Broker
from msgpatterns.deadletter import DeadLetter
from msgpatterns.message import Message

__all__ = ["ThreadedAsyncBroker"]


class ThreadedAsyncBroker:
    """The async face of the sync broker :attr:`sync` (every guarantee is its own).

    Dead-letter admin and other extras stay on :attr:`sync`.
    """

    def __init__(self, broker: Broker) -> None:
        self.sync = broker

    def now(self) -> float:
        return self.sync.now()

    async def publish(self, topic: str, body: Any, *, key: str | None = None,
                      headers: Mapping[str, str] | None = None) -> str:
        return await asyncio.to_thread(self.sync.publish, topic, body, key=key,
                                       headers=headers)

    async def publish_many(self, topic: str, items: Iterable[Any]) -> list[str]:
        publish_many = getattr(self.sync, "publish_many")  # noqa: B009 - not in the protocol
        result: list[str] = await asyncio.to_thread(publish_many, topic, list(items))
        return result

    async def subscribe(self, topic: str, group: str) -> None:
        subscribe = getattr(self.sync, "subscribe", None)
        if subscribe is not None:
            await asyncio.to_thread(subscribe, topic, group)

    async def fetch(self, topics: Sequence[str], group: str, max_messages: int = 1,
                    timeout: float = 0.0) -> list[Message]:
        if isinstance(topics, str):
            topics = [topics]
        return await asyncio.to_thread(self.sync.fetch, list(topics), group, max_messages,
                                       timeout)

    async def ack(self, message: Message) -> None:
        await asyncio.to_thread(self.sync.ack, message)

    async def nack(self, message: Message, delay: float = 0.0) -> None:
        await asyncio.to_thread(self.sync.nack, message, delay)

    async def dead_letter(self, message: Message, record: DeadLetter) -> None:
        await asyncio.to_thread(self.sync.dead_letter, message, record)

    async def close(self) -> None:
        await asyncio.to_thread(self.sync.close)

    async def __aenter__(self) -> ThreadedAsyncBroker:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sync!r})"
