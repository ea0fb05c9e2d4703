"""The :class:`AsyncBroker` protocol: the Broker verbs as coroutines.

Same five verbs, same meaning, same wire format as :mod:`msgpatterns.brokers.base`
(an async adapter and a sync adapter of one broker read each other's messages, retries
and dead letters): ``fetch`` (deliveries with a durable ``attempt``), ``ack``,
``nack(delay)`` (redeliver with ``attempt + 1`` and the message's headers at the time
of the call), ``dead_letter`` (park with the full record), ``publish``; ``now()`` is the
broker's clock and stays a plain call; ``close()`` is awaited, after which every
operation raises :class:`~msgpatterns.errors.BrokerClosed`. The library's adapters also
have ``aclose()`` (the same, under the name every async part has) and ``async with``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from msgpatterns.deadletter import DeadLetter
from msgpatterns.message import Message

__all__ = ["AsyncBroker"]


@runtime_checkable
class AsyncBroker(Protocol):
    """What :class:`~msgpatterns.aio.AsyncConsumer` needs from a broker client."""

    async def fetch(
        self,
        topics: Sequence[str],
        group: str,
        max_messages: int = 1,
        timeout: float = 0.0,
    ) -> list[Message]: ...

    async def ack(self, message: Message) -> None: ...

    async def nack(self, message: Message, delay: float = 0.0) -> None: ...

    async def dead_letter(self, message: Message, record: DeadLetter) -> None: ...

    async def publish(
        self,
        topic: str,
        body: Any,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> str: ...

    def now(self) -> float:
        """The broker's clock in seconds since the epoch (virtual on the fake)."""
        ...

    async def close(self) -> None:
        """Send what is queued, release connections; idempotent."""
        ...
