"""Flusher: a batch goes out when it is full or its oldest item has waited long enough."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

from msgpatterns.batching.core import BatchQueue, ErrorHook
from msgpatterns.errors import ConfigurationError, seconds

__all__ = ["Flusher", "interval_seconds"]

T = TypeVar("T")


def interval_seconds(flush_interval: float | timedelta) -> float:
    """``flush_interval`` in seconds; it must be positive."""
    value = seconds(flush_interval)
    if not value or value <= 0:
        raise ConfigurationError(f"flush_interval must be positive, got {flush_interval!r}")
    return value


class Flusher(BatchQueue[T, list[T]]):
    """Hands items to ``processor(list)`` in batches of ``batch_size``, or sooner when
    the oldest queued item has waited ``flush_interval`` seconds.

    The wait is measured from each batch's oldest item, so no item waits longer than
    ``flush_interval`` plus scheduling noise while a worker is free.

    Args:
        name: prefix of the worker thread names (``name-0``, ``name-1``, ...).
        batch_size: items per processor call (fewer when the interval runs out).
        flush_interval: longest an item waits for its batch to fill (seconds or
            ``timedelta``).
        queue_size: most items accepted and not processed yet (queued or running).
        threads: worker threads (batches run concurrently, in no particular order).
        processor: ``processor(items)``; an exception is logged, counted, passed to
            ``on_error`` and never stops the worker.
        ack_messages: ack the :class:`~msgpatterns.Message` items of each batch after
            the processor returns, or with its exception when it raises.
        on_error: ``on_error(exception, items)`` after a processor call raised,
            before the messages are acked with the exception.
    """

    def __init__(
        self,
        name: str,
        batch_size: int,
        flush_interval: float | timedelta,
        queue_size: int,
        threads: int,
        processor: Callable[[list[T]], object],
        ack_messages: bool = False,
        *,
        on_error: ErrorHook[list[T]] | None = None,
    ) -> None:
        self.flush_interval = interval_seconds(flush_interval)
        super().__init__(
            name,
            processor=processor,
            batch_size=batch_size,
            capacity=queue_size,
            threads=threads,
            max_wait=self.flush_interval,
            ack_messages=ack_messages,
            on_error=on_error,
        )

    def _batch(self, index: int, items: list[T]) -> list[T]:
        return items
