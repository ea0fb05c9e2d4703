"""Async batching: :class:`AsyncBatchExecutor`, :class:`AsyncFlusher` and
:class:`AsyncMultipleQueueFlusher` hand items to an ``async def`` processor in batches.

They are the sync helpers of :mod:`msgpatterns.batching` driven by worker *tasks*
instead of worker threads: the same :class:`~msgpatterns.batching.core.BatchPolicy`
(which channel, how long a batch may wait, what the processor gets) and the same
:class:`~msgpatterns.batching.core.BatchState` (capacity, which batch goes next,
deadlines, flush and close marks, who to wake, counters, logging, ``on_error`` and
acks) decide everything, as steps both drivers run; this module only performs the
waits (on ``asyncio.Condition``) and awaits the processor.
So every guarantee of the sync helpers holds, with ``await``:

* ``await add(item, timeout=None) -> bool``: True once accepted; when the queue is
  full, False at once, or after waiting up to ``timeout`` seconds for room. Capacity is
  exact (queued plus in a running batch). ``QueueClosed`` after :meth:`aclose`, also
  to a producer waiting for room.
* ``await flush(timeout=None)`` sends out every item accepted before it and waits for
  them; ``await aclose(timeout=None)`` refuses new items and returns once every
  accepted item is processed and the workers have ended (False after ``timeout``: the
  workers go on draining and a later ``aclose()`` waits again). ``async with`` closes
  on exit. Either one awaited from the processor raises ``RuntimeError``.
* A processor exception - any ``BaseException``, a ``CancelledError`` the processor
  raises of its own included - is logged, counted, passed to ``on_error`` (a plain
  function) and acks the batch's messages with the error (``ack_messages``); the worker
  goes on. A worker task that is itself cancelled (the loop shutting down) fails its
  running batch the same way, then ends.
* Workers start on the first ``add``, on the running loop; all calls belong to that
  loop. Await :meth:`aclose` before the loop ends: items still queued when the loop
  cancels the workers are not processed (unacked messages among them are redelivered
  by the broker).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Callable
from datetime import timedelta
from types import TracebackType
from typing import Any, Self, TypeVar

from msgpatterns._callables import require_async_callable
from msgpatterns.batching.core import (
    BatchCounters,
    BatchDriver,
    Done,
    ErrorHook,
    ListPolicy,
    Steps,
)
from msgpatterns.batching.flusher import FlushPolicy, WithFlushInterval
from msgpatterns.batching.multiple import Group, RoutePolicy

__all__ = ["AsyncBatchExecutor", "AsyncBatchQueue", "AsyncFlusher", "AsyncMultipleQueueFlusher"]

T = TypeVar("T")
B = TypeVar("B")
R = TypeVar("R")

#: The helper whose worker task this is (flush/aclose there would wait for itself).
_worker_of: contextvars.ContextVar[object] = contextvars.ContextVar(
    "msgpatterns_async_batch_worker", default=None)


async def _wait(condition: asyncio.Condition, timeout: float | None) -> None:
    """Wait on ``condition`` (held) until notified or ``timeout`` seconds pass; either
    way the lock is held again on return."""
    if timeout is None:
        await condition.wait()
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await condition.wait()


def _being_cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class AsyncBatchQueue(BatchDriver[T, B]):
    """Bounded queues of items handed to an ``async def`` processor in batches by
    worker tasks: the asyncio driver of a :class:`~msgpatterns.batching.core.BatchState`
    (it runs the state's steps, awaiting each wait on an ``asyncio.Condition``).

    The base of the three async helpers; each passes the policy of its sync twin.
    The methods are those of :class:`~msgpatterns.batching.core.BatchQueue`, awaited,
    with ``aclose`` for ``close``.
    """

    def _check_processor(self, processor: Callable[[B], Any], where: str) -> None:
        sync_twin = type(self).__name__.removeprefix("Async")
        require_async_callable(processor, what="processor", where=where,
                               alternative=f"msgpatterns.{sync_twin}")

    def _setup(self) -> None:
        self._lock = asyncio.Lock()
        self._conditions = self._state.bind(lambda: asyncio.Condition(self._lock))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def add(self, item: T, timeout: float | timedelta | None = None) -> bool:
        """:meth:`BatchQueue.add <msgpatterns.batching.core.BatchQueue.add>`, awaited:
        True once accepted; False when the queue stays full (at once, or after waiting
        up to ``timeout`` seconds for room); ``QueueClosed`` after :meth:`aclose`.
        Starts the worker tasks on the running loop the first time."""
        steps = self._state.add(item, timeout)
        async with self._lock:
            self._start()
            accepted = await self._run_steps(steps)
        return self._state.added(accepted)

    async def flush(self, timeout: float | timedelta | None = None) -> bool:
        """:meth:`BatchQueue.flush <msgpatterns.batching.core.BatchQueue.flush>`,
        awaited: every item accepted before it goes out now; True once processed."""
        self._refuse_from_worker("flush")
        async with self._lock:
            return await self._run_steps(self._state.flush(timeout))

    async def aclose(self, timeout: float | timedelta | None = None) -> bool:
        """:meth:`BatchQueue.close <msgpatterns.batching.core.BatchQueue.close>`,
        awaited: True once every accepted item is processed and the worker tasks have
        ended; False after ``timeout`` (the workers go on draining, a later
        ``aclose()`` waits again)."""
        self._refuse_from_worker("aclose")
        async with self._lock:
            finished = await self._run_steps(self._state.close(timeout))
        if finished and self._tasks:
            await asyncio.wait(self._tasks)  # each ends once closed and drained
        return finished

    @property
    def counters(self) -> BatchCounters:
        """A consistent snapshot of the counters."""
        return self._state.counters()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    # -- the waiting ----------------------------------------------------------------

    async def _run_steps(self, steps: Steps[R]) -> R:
        """With the lock held: run ``steps``, awaiting each :class:`Wait`."""
        for step in steps:
            if isinstance(step, Done):
                return step.value
            await _wait(self._conditions[step.condition], step.timeout)
        raise AssertionError("steps ended without a result")

    def _start(self) -> None:
        """Start the worker tasks on the running loop, once (not after a close)."""
        loop = asyncio.get_running_loop()
        if self._loop is None and not self._state.closed:
            self._loop = loop
            self._tasks = [
                loop.create_task(self._run(), name=f"{self.name}-{i}")
                for i in range(self._workers)
            ]
        elif self._loop is not None and self._loop is not loop:
            raise RuntimeError(f"{self.name} belongs to another event loop")

    def _refuse_from_worker(self, what: str) -> None:
        if _worker_of.get() is self:
            raise RuntimeError(f"{self.name}: {what}() from the processor would wait for itself")

    async def _run(self) -> None:
        _worker_of.set(self)
        state = self._state
        while True:
            async with self._lock:
                job = await self._run_steps(state.next_job())
            if job is None:
                return
            error: BaseException | None = None
            try:
                await self._processor(job.batch)
            except BaseException as exc:  # fails the batch only, never the worker
                error = exc
            failed = state.settle(job, error)
            async with self._lock:  # uncontended while cancelled: no await point
                state.finish(job, failed)
            if isinstance(error, asyncio.CancelledError) and _being_cancelled():
                raise error  # this worker itself is being cancelled: its batch is settled


class AsyncBatchExecutor(AsyncBatchQueue[T, list[T]]):
    """:class:`~msgpatterns.BatchExecutor` with worker tasks: a free worker takes
    whatever is queued, up to ``batch_size`` items, and awaits ``processor(items)``.

    The arguments of ``BatchExecutor``, with ``workers`` (tasks, keyword) in place of
    ``threads``; ``processor`` is an ``async def`` (a plain function raises
    ``TypeError`` naming ``msgpatterns.BatchExecutor``).
    """

    def __init__(
        self, name: str, batch_size: int, processor: Callable[[list[T]], Awaitable[object]],
        *, workers: int = 1, queue_size: int = 1000, ack_messages: bool = False,
        on_error: ErrorHook[list[T]] | None = None,
    ) -> None:
        super().__init__(name, ListPolicy(), processor=processor, batch_size=batch_size,
                         capacity=queue_size, workers=workers, ack_messages=ack_messages,
                         on_error=on_error)


class AsyncFlusher(WithFlushInterval, AsyncBatchQueue[T, list[T]]):
    """:class:`~msgpatterns.Flusher` with worker tasks: a batch of ``batch_size`` goes
    out at once, a smaller one when its oldest item has waited ``flush_interval``.

    The arguments of ``Flusher``, with ``workers`` (tasks, keyword) in place of
    ``threads``; ``processor`` is an ``async def`` (a plain function raises
    ``TypeError`` naming ``msgpatterns.Flusher``).
    """

    def __init__(
        self, name: str, batch_size: int, flush_interval: float | timedelta,
        queue_size: int, processor: Callable[[list[T]], Awaitable[object]], *,
        workers: int = 1, ack_messages: bool = False, on_error: ErrorHook[list[T]] | None = None,
    ) -> None:
        super().__init__(name, FlushPolicy(flush_interval), processor=processor,
                         batch_size=batch_size, capacity=queue_size, workers=workers,
                         ack_messages=ack_messages, on_error=on_error)


class AsyncMultipleQueueFlusher(WithFlushInterval, AsyncBatchQueue[T, Group[T]]):
    """:class:`~msgpatterns.MultipleQueueFlusher` with worker tasks: ``route(item)``
    (a plain function) picks the channel, ``queue_size`` is per channel, the processor
    awaits a :class:`~msgpatterns.Group` of one channel.

    The arguments of ``MultipleQueueFlusher``, with ``workers`` (tasks, keyword) in
    place of ``threads``; ``processor`` is an ``async def`` (a plain function raises
    ``TypeError`` naming ``msgpatterns.MultipleQueueFlusher``).
    """

    def __init__(
        self, name: str, channels: int, queue_size: int, batch_size: int,
        flush_interval: float | timedelta, route: Callable[[T], int],
        processor: Callable[[Group[T]], Awaitable[object]], *, workers: int = 1,
        ack_messages: bool = False, on_error: ErrorHook[Group[T]] | None = None,
    ) -> None:
        where = f"{type(self).__name__} {name!r}"
        super().__init__(name, RoutePolicy(channels, route, flush_interval, where),
                         processor=processor, batch_size=batch_size,
                         capacity=queue_size, workers=workers, ack_messages=ack_messages,
                         on_error=on_error)

    @property
    def channels(self) -> int:
        """The number of channels."""
        return len(self._state.channels)
