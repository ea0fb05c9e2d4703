"""Write-behind completion: mark keys DONE in background batches, off the handler's path.

With it, a guarded call costs one store round trip (the claim) instead of two: the
completion is queued and written within ``interval`` seconds, many per round trip.
Until then the key stays PROCESSING under the caller's token, so a duplicate from
another process is told ``InProgress`` (and comes back later to find it DONE), and a
duplicate in this process is skipped at once.

The trade-off: if the process dies within ``interval`` after a handler returned, that
key's completion is lost; its lease expires and a later duplicate is processed again.
Without write-behind the same can happen, but only in the one round trip between the
effect and its completion. Either way the effect is never lost (at-least-once).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from msgpatterns.errors import StoreUnavailable
from msgpatterns.idempotency.records import Claim

if TYPE_CHECKING:
    from msgpatterns.batching import Flusher


class CompletesMany(Protocol):
    """What a write-behind needs of its checker (a lease checker)."""

    def complete_many(self, claims: Sequence[Claim]) -> Any: ...

__all__ = ["AsyncWriteBehind", "WriteBehind"]

log = logging.getLogger("msgpatterns.idempotency")

BATCH = 100
QUEUE = 10_000


def _not_recorded(count: int, error: StoreUnavailable) -> None:
    log.error("%d completion(s) not recorded (%s); their leases will expire and "
              "duplicates delivered after that are applied again", count, error)


class _Pending:
    """The completions queued and not written yet, by key."""

    def __init__(self) -> None:
        self._pending: dict[str, Claim] = {}

    def pending(self, key: str) -> Claim | None:
        """The queued completion of ``key``, if any (that key is done, not written yet)."""
        return self._pending.get(key)

    def _written(self, claims: Sequence[Claim]) -> None:
        for claim in claims:
            if self._pending.get(claim.key) is claim:
                self._pending.pop(claim.key, None)


class WriteBehind(_Pending):
    """Queues a checker's completions and writes them with ``complete_many``."""

    def __init__(self, checker: CompletesMany, interval: float) -> None:
        super().__init__()
        self.checker = checker
        self.interval = interval
        self._flusher: Flusher[Claim] | None = None
        self._lock = threading.Lock()

    def add(self, claim: Claim) -> bool:
        """Queue ``claim``'s completion; False when the queue is full (complete it now)."""
        self._pending[claim.key] = claim
        if self._started().add(claim):
            return True
        self._pending.pop(claim.key, None)
        return False

    def _started(self) -> Flusher[Claim]:
        flusher = self._flusher
        if flusher is None:
            with self._lock:
                if self._flusher is None:
                    from msgpatterns.batching import Flusher

                    self._flusher = Flusher(
                        "msgpatterns-complete", BATCH, self.interval, QUEUE, 1, self._write,
                    )
                    atexit.register(self._flusher.close)
                flusher = self._flusher
        return flusher

    def _write(self, claims: list[Claim]) -> None:
        try:
            self.checker.complete_many(claims)
        except StoreUnavailable as exc:
            _not_recorded(len(claims), exc)
        finally:
            self._written(claims)

    def flush(self, timeout: float | None = None) -> bool:
        """Write every queued completion; False if ``timeout`` ran out first."""
        return self._flusher.flush(timeout) if self._flusher is not None else True

    def close(self, timeout: float | None = None) -> None:
        """Write every queued completion and stop the writer thread."""
        flusher, self._flusher = self._flusher, None
        if flusher is not None:
            flusher.close(timeout)
            atexit.unregister(flusher.close)


class AsyncWriteBehind(_Pending):
    """Write-behind on the event loop: completions queued by ``add`` are written by one
    task, ``interval`` seconds after the first of a batch, up to ``BATCH`` per round
    trip (``complete``). :meth:`flush` writes what is queued and waits for it."""

    def __init__(self, complete: Callable[[Sequence[Claim]], Awaitable[list[bool]]],
                 interval: float) -> None:
        super().__init__()
        self._complete = complete
        self.interval = interval
        self._queue: list[Claim] = []
        self._task: asyncio.Task[None] | None = None
        self._sleeping = False

    async def add(self, claim: Claim) -> bool:
        """Queue ``claim``'s completion; False when the queue is full (complete it now)."""
        if len(self._queue) >= QUEUE:
            return False
        self._pending[claim.key] = claim
        self._queue.append(claim)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._later())
        return True

    async def _later(self) -> None:
        self._sleeping = True
        try:
            await asyncio.sleep(self.interval)
        finally:
            self._sleeping = False
        await self._write_all()

    async def _write_all(self) -> None:
        while self._queue:
            claims, self._queue = self._queue[:BATCH], self._queue[BATCH:]
            try:
                await self._complete(claims)
            except StoreUnavailable as exc:
                _not_recorded(len(claims), exc)
            finally:
                self._written(claims)

    async def flush(self) -> None:
        """Write every queued completion now (and end the waiting task)."""
        task = self._task
        if task is not None and not task.done():
            if self._sleeping:  # nothing in flight: end its wait, write here
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._write_all()
