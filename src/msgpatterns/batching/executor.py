"""BatchExecutor: batch only as much as the processor's speed calls for."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from msgpatterns.batching.core import BatchQueue, ErrorHook, ListPolicy

__all__ = ["BatchExecutor"]

T = TypeVar("T")


class BatchExecutor(BatchQueue[T, list[T]]):
    """Hands queued items to ``processor(list)`` without ever waiting for a batch to fill.

    A free worker takes whatever is queued, up to ``batch_size`` items. When the
    processor keeps up, each item goes out alone and at once; when it falls behind,
    items pile up and the next batches grow (never past ``batch_size``). Its policy
    is :class:`~msgpatterns.batching.core.ListPolicy`: one channel, no wait.

    Args:
        name: prefix of the worker thread names (``name-0``, ``name-1``, ...).
        batch_size: most items per processor call.
        processor: ``processor(items)``, a sync callable (an ``async def`` is
            refused, naming :class:`msgpatterns.aio.AsyncBatchExecutor`); an
            exception, even a ``SystemExit``, is logged, counted, passed to
            ``on_error`` and never stops the worker.
        threads: worker threads (batches run concurrently, in no particular order).
        queue_size: most items accepted and not processed yet (queued or running).
        ack_messages: ack the :class:`~msgpatterns.Message` items of each batch after
            the processor returns, or with its exception when it raises. Every item
            must then be a Message: ``add`` raises ``TypeError`` for anything else.
        on_error: ``on_error(exception, items)`` after a processor call raised,
            before the messages are acked with the exception.
    """

    def __init__(
        self,
        name: str,
        batch_size: int,
        processor: Callable[[list[T]], object],
        threads: int = 2,
        queue_size: int = 1000,
        ack_messages: bool = False,
        *,
        on_error: ErrorHook[list[T]] | None = None,
    ) -> None:
        super().__init__(name, ListPolicy(), processor=processor, batch_size=batch_size,
                         capacity=queue_size, workers=threads, ack_messages=ack_messages,
                         on_error=on_error)
