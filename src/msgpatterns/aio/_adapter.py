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
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Self

from msgpatterns.deadletter import body_bytes
from msgpatterns.errors import BrokerClosed

if TYPE_CHECKING:
    from msgpatterns.brokers.admin.base import DeadLetterAdmin

__all__ = ["AsyncBrokerAdapter"]


class AsyncBrokerAdapter(ABC):
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

    @property
    @abstractmethod
    def closed(self) -> bool:
        """True once :meth:`close` was called."""

    def _check_open(self) -> None:
        if self.closed:
            raise BrokerClosed(f"{self!r} is closed")

    @abstractmethod
    async def close(self) -> None:
        """Send what is queued, release connections; idempotent."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @abstractmethod
    def dead_letter_admin(self) -> DeadLetterAdmin:
        """The (sync) dead-letter admin over this adapter's topology; its ``close()``
        releases what it opened, never this adapter."""
