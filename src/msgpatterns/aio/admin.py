"""AsyncDeadLetters: any :class:`~msgpatterns.brokers.admin.DeadLetterAdmin` for code
running in an event loop.

The admin logic exists once, in the sync admins (one per broker); this wrapper runs
each call in a worker thread so the loop never blocks on the broker, as
:class:`~msgpatterns.aio.ThreadedAsyncBroker` does for a broker::

    async with AsyncDeadLetters(broker.dead_letter_admin()) as admin:
        for record in await admin.list_dead_letters("orders", "billing"):
            ...
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection

from msgpatterns.brokers.admin.base import DeadLetterAdmin
from msgpatterns.deadletter import DeadLetter

__all__ = ["AsyncDeadLetters"]


class AsyncDeadLetters:
    """The :class:`~msgpatterns.brokers.admin.DeadLetterAdmin` operations of
    :attr:`sync`, awaitable (same arguments, same guarantees)."""

    def __init__(self, admin: DeadLetterAdmin) -> None:
        self.sync = admin

    async def list_dead_letters(self, topic: str, group: str | None = None, *,
                                limit: int | None = None) -> list[DeadLetter]:
        return await asyncio.to_thread(self.sync.list_dead_letters, topic, group,
                                       limit=limit)

    async def replay_dead_letters(self, topic: str, group: str | None = None,
                                  ids: Collection[str] | None = None, *,
                                  to_topic: bool = False) -> int:
        return await asyncio.to_thread(self.sync.replay_dead_letters, topic, group, ids,
                                       to_topic=to_topic)

    async def purge_dead_letters(self, topic: str, group: str | None = None,
                                 ids: Collection[str] | None = None) -> int:
        return await asyncio.to_thread(self.sync.purge_dead_letters, topic, group, ids)

    async def knows(self, topic: str, group: str | None = None) -> bool:
        return await asyncio.to_thread(self.sync.knows, topic, group)

    async def close(self) -> None:
        """Close the sync admin (in a worker thread); idempotent."""
        await asyncio.to_thread(self.sync.close)

    async def aclose(self) -> None:
        """:meth:`close`, under the name every async part of msgpatterns has."""
        await self.close()

    async def __aenter__(self) -> AsyncDeadLetters:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncDeadLetters({self.sync!r})"
