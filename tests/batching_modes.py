"""The batching helpers of either API behind the sync one's face, so one test body
checks BatchExecutor, Flusher and MultipleQueueFlusher and their async twins.

On the async side the helper's coroutines (``add``, ``flush``, ``aclose``, ``async
with``) run on an event loop in an anyio blocking portal while the calling thread
waits, exactly as a sync caller of the sync helper waits; the test's processor (a
plain function, which may block on a gate) is handed over as an ``async def`` that
awaits it in a worker thread, so the loop never blocks and several worker tasks can
be inside the processor at once, like several worker threads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType
from typing import Any, Literal

import anyio.to_thread
from anyio.from_thread import BlockingPortal, start_blocking_portal

from msgpatterns import BatchExecutor, Flusher, Group, MultipleQueueFlusher
from msgpatterns.aio import AsyncBatchExecutor, AsyncFlusher, AsyncMultipleQueueFlusher

Mode = Literal["sync", "async"]
MODES: list[Mode] = ["sync", "async"]
Kind = Literal["executor", "flusher", "multiple"]
KINDS: list[Kind] = ["executor", "flusher", "multiple"]
CHANNELS = 3
LONG = 3600.0  # a flush interval no test waits for


def items_of(batch: Any) -> list[Any]:
    """The items of a batch, whether the processor got a list or a Group."""
    return list(batch.items) if isinstance(batch, Group) else list(batch)


class AsyncSide:
    """An async helper with the sync helper's methods: ``add``, ``flush``, ``close``
    (``aclose``), ``with`` (``async with``); the rest (``counters``, ``closed``) read
    through."""

    def __init__(self, portal: BlockingPortal, helper: Any) -> None:
        self.portal, self.helper = portal, helper
        self._entered: Any = None

    def add(self, item: Any, timeout: float | None = None) -> bool:
        return bool(self.portal.call(self.helper.add, item, timeout))

    def flush(self, timeout: float | None = None) -> bool:
        return bool(self.portal.call(self.helper.flush, timeout))

    def close(self, timeout: float | None = None) -> bool:
        return bool(self.portal.call(self.helper.aclose, timeout))

    def __enter__(self) -> AsyncSide:
        self._entered = self.portal.wrap_async_context_manager(self.helper)
        self._entered.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> bool | None:
        entered, self._entered = self._entered, None
        return entered.__exit__(kind, error, trace)  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.helper, name)


def awaiting(processor: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``processor`` as an ``async def`` that awaits it in a worker thread."""
    async def process(batch: Any) -> Any:
        return await anyio.to_thread.run_sync(processor, batch)

    return process


class Batching:
    """Builds the three helpers on the sync API or on the async one (``mode``)."""

    def __init__(self, mode: Mode, portal: BlockingPortal | None = None) -> None:
        self.mode, self.portal = mode, portal

    def __call__(self, kind: Kind, processor: Callable[[Any], object], **options: Any) -> Any:
        """Same as :meth:`make`."""
        return self.make(kind, processor, **options)

    def make(
        self,
        kind: Kind,
        processor: Callable[[Any], object],
        *,
        name: str = "batcher",
        batch_size: int = 10,
        queue_size: int = 100,
        threads: int = 2,
        flush_interval: float = LONG,
        ack_messages: bool = False,
        on_error: Callable[[BaseException, Any], object] | None = None,
        channels: int = CHANNELS,
        route: Callable[[Any], int] = lambda item: hash(item) % CHANNELS,
        groups: bool = False,
    ) -> Any:
        """One helper of ``kind``; ``threads`` is the async helpers' ``workers``. A
        MultipleQueueFlusher's processor gets its Group's items (checked to be of the
        group's channel), or the Group itself with ``groups``."""
        if kind == "multiple" and not groups:
            plain = processor

            def per_group(group: Group[Any]) -> object:
                assert all(route(item) == group.index for item in group.items), group
                return plain(group.items)

            processor = per_group
        options: dict[str, Any] = {"ack_messages": ack_messages, "on_error": on_error}
        if self.portal is None:
            if kind == "executor":
                return BatchExecutor(name, batch_size, processor, threads=threads,
                                     queue_size=queue_size, **options)
            if kind == "flusher":
                return Flusher(name, batch_size, flush_interval, queue_size, threads,
                               processor, **options)
            return MultipleQueueFlusher(name, channels, queue_size, batch_size,
                                        flush_interval, threads, route, processor, **options)
        process = awaiting(processor)
        helper: Any
        if kind == "executor":
            helper = AsyncBatchExecutor(name, batch_size, process, workers=threads,
                                        queue_size=queue_size, **options)
        elif kind == "flusher":
            helper = AsyncFlusher(name, batch_size, flush_interval, queue_size, process,
                                  workers=threads, **options)
        else:
            helper = AsyncMultipleQueueFlusher(name, channels, queue_size, batch_size,
                                               flush_interval, route, process,
                                               workers=threads, **options)
        return AsyncSide(self.portal, helper)


@contextmanager
def batching(mode: Mode) -> Iterator[Batching]:
    """A :class:`Batching` of ``mode`` (the async one with its event loop running)."""
    if mode == "sync":
        yield Batching(mode)
        return
    with start_blocking_portal("asyncio") as portal:
        yield Batching(mode, portal)
