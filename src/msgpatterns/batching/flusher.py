"""Flusher: a batch goes out when it is full or its oldest item has waited long enough."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from msgpatterns.batching.core import BatchQueue, BatchState, ErrorHook, ListPolicy, duration
from msgpatterns.errors import ConfigurationError

__all__ = ["FlushPolicy", "Flusher", "WithFlushInterval", "interval_seconds"]

T = TypeVar("T")


def interval_seconds(flush_interval: float | timedelta) -> float:
    """``flush_interval`` in seconds; it must be positive (ConfigurationError naming
    ``flush_interval`` otherwise, for every form: float, int or timedelta)."""
    value = duration("flush_interval", flush_interval)
    if not value or value <= 0:
        raise ConfigurationError(f"flush_interval must be positive, got {flush_interval!r}")
    return value


class FlushPolicy(ListPolicy[T]):
    """One channel; a batch waits at most ``flush_interval`` (seconds or ``timedelta``,
    positive) from its oldest item; the processor gets a list."""

    def __init__(self, flush_interval: float | timedelta) -> None:
        self.max_wait = interval_seconds(flush_interval)


class WithFlushInterval:
    """The ``flush_interval`` attribute of the flushers (sync and async): the seconds
    a batch may wait to fill up, their policy's ``max_wait``."""

    _state: BatchState[Any, Any]

    @property
    def flush_interval(self) -> float:
        return self._state.policy.max_wait


class Flusher(WithFlushInterval, BatchQueue[T, list[T]]):
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
        processor: ``processor(items)``, a sync callable (an ``async def`` is
            refused, naming :class:`msgpatterns.aio.AsyncFlusher`); an exception, even
            a ``SystemExit``, is logged, counted, passed to ``on_error`` and never
            stops the worker.
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
        flush_interval: float | timedelta,
        queue_size: int,
        threads: int,
        processor: Callable[[list[T]], object],
        ack_messages: bool = False,
        *,
        on_error: ErrorHook[list[T]] | None = None,
    ) -> None:
        super().__init__(name, FlushPolicy(flush_interval), processor=processor,
                         batch_size=batch_size, capacity=queue_size, workers=threads,
                         ack_messages=ack_messages, on_error=on_error)
