"""AsyncBrokerAdapter: the plumbing every async broker adapter shares.

The async twin of :class:`msgpatterns.brokers._adapter.BrokerAdapter`: the ``publish``
signature (an adapter writes only ``_publish``, the body already bytes), ``now()``, the
closed-state check, ``async with``, and ``dead_letter_admin()`` - the sync
:class:`~msgpatterns.brokers.admin.DeadLetterAdmin` over the same topology (the wire
format is shared, so it manages what sync and async consumers dead-lettered alike; in
a running event loop wrap it in :class:`~msgpatterns.aio.admin.AsyncDeadLetters`).
"""

from __future__ import annotations

import time
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Self

from msgpatterns.brokers._adapter import Closable, WireTrust, topic_list
from msgpatterns.deadletter import body_bytes
from msgpatterns.message import Message

if TYPE_CHECKING:
    from msgpatterns.brokers.admin.base import DeadLetterAdmin

__all__ = ["AsyncBrokerAdapter"]


class AsyncBrokerAdapter(WireTrust, Closable):
    """Base class of the async adapters (see the module docstring)."""

    def now(self) -> float:
        """The broker's clock: seconds since the epoch."""
        return time.time()

    async def publish(self, topic: str, body: Any, *, key: str | None = None,
                      headers: Mapping[str, str] | None = None) -> str:
        """Send ``body`` to ``topic``, confirmed by the broker; returns the message id
        every consumer sees. Raises :class:`~msgpatterns.errors.BrokerClosed` after
        :meth:`close`."""
        self._check_open()
        return await self._publish(topic, body_bytes(body), key, headers or {})

    @abstractmethod
    async def _publish(self, topic: str, payload: bytes, key: str | None,
                       headers: Mapping[str, str]) -> str:
        """Send one message (the adapter's wire encoding); its id."""

    async def fetch(self, topics: str | Sequence[str], group: str, max_messages: int = 1,
                    timeout: float = 0.0) -> list[Message]:
        """Up to ``max_messages`` deliveries of ``topics`` (one topic name is accepted
        too) for ``group``, waiting up to ``timeout`` seconds when none is ready."""
        return await self._fetch_messages(topic_list(topics), group, max_messages, timeout)

    @abstractmethod
    async def _fetch_messages(self, topics: list[str], group: str, max_messages: int,
                              timeout: float) -> list[Message]:
        """:meth:`fetch` with the topics as a list."""

    @abstractmethod
    async def close(self) -> None:
        """Send what is queued, release connections; idempotent."""

    async def aclose(self) -> None:
        """:meth:`close`, under the name every async part of msgpatterns has."""
        await self.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @abstractmethod
    def dead_letter_admin(self) -> DeadLetterAdmin:
        """The (sync) dead-letter admin over this adapter's topology; its ``close()``
        releases what it opened, never this adapter."""
