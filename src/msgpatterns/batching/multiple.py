"""MultipleQueueFlusher: one Flusher queue per channel (shard, table), one channel per batch."""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Generic, TypeVar

from msgpatterns._callables import require_sync_callable
from msgpatterns.batching.core import BatchPolicy, BatchQueue, ErrorHook, count
from msgpatterns.batching.flusher import WithFlushInterval, interval_seconds
from msgpatterns.errors import InvalidChannel

__all__ = ["Group", "MultipleQueueFlusher", "RoutePolicy", "RouteError"]

T = TypeVar("T")

#: ``route(item)`` did not return a channel index in ``range(channels)``: the name
#: this error has here (:class:`~msgpatterns.errors.InvalidChannel` in ``errors``,
#: where ``RouteError`` is the ordered topics' route error).
RouteError = InvalidChannel


@dataclass(frozen=True, slots=True)
class Group(Generic[T]):
    """A batch of one channel: ``items`` all went to channel ``index``."""

    index: int
    items: list[T]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[T]:
        return iter(self.items)


class RoutePolicy(BatchPolicy[T, Group[T]]):
    """``channels`` channels picked by ``route(item) -> int`` (a sync callable); each
    batch waits at most ``flush_interval`` from its oldest item; the processor gets a
    :class:`Group` of one channel. ``where`` names the helper in errors."""

    def __init__(
        self, channels: int, route: Callable[[T], int], flush_interval: float | timedelta,
        where: str,
    ) -> None:
        self.max_wait = interval_seconds(flush_interval)
        self.channels = count("channels", channels)
        require_sync_callable(route, what="route", where=where)
        self.route = route

    def channel_of(self, item: T, name: str) -> int:
        chosen = self.route(item)
        try:
            index = operator.index(chosen)
        except TypeError:
            raise RouteError(f"{name}: route returned {chosen!r}, not an int") from None
        if not 0 <= index < self.channels:
            raise RouteError(
                f"{name}: route returned channel {index}, outside 0..{self.channels - 1}"
            )
        return index

    def batch(self, index: int, items: list[T]) -> Group[T]:
        return Group(index, items)


class MultipleQueueFlusher(WithFlushInterval, BatchQueue[T, Group[T]]):
    """A :class:`~msgpatterns.batching.Flusher` per channel sharing one pool of workers.

    ``route(item)`` picks the channel (a shard, a table); the processor receives a
    :class:`Group` whose items all come from that one channel. A channel's batch goes
    out when it has ``batch_size`` items or its oldest item has waited
    ``flush_interval``; when several are due, the one with the oldest item goes first.

    Args:
        name: prefix of the worker thread names (``name-0``, ``name-1``, ...).
        channels: number of channels; ``route`` returns ``0 .. channels - 1``.
        queue_size: capacity of **each** channel: most items accepted and not processed
            yet (queued or running) per channel, so a full hot channel never blocks the
            others. The whole helper holds at most ``channels * queue_size`` items.
        batch_size: items per processor call (fewer when the interval runs out).
        flush_interval: longest an item waits for its batch to fill (seconds or
            ``timedelta``).
        threads: worker threads shared by all channels.
        route: ``route(item) -> int``, a sync callable; an index outside ``range(channels)`` makes
            ``add`` raise :class:`RouteError` and the item is not accepted.
        processor: ``processor(group)``, a sync callable (an ``async def`` is
            refused, naming :class:`msgpatterns.aio.AsyncMultipleQueueFlusher`); an
            exception, even a ``SystemExit``, is logged, counted, passed to
            ``on_error`` and never stops the worker.
        ack_messages: ack the :class:`~msgpatterns.Message` items of each group after
            the processor returns, or with its exception when it raises. Every item
            must then be a Message: ``add`` raises ``TypeError`` for anything else.
        on_error: ``on_error(exception, group)`` after a processor call raised,
            before the messages are acked with the exception.
    """

    def __init__(
        self,
        name: str,
        channels: int,
        queue_size: int,
        batch_size: int,
        flush_interval: float | timedelta,
        threads: int,
        route: Callable[[T], int],
        processor: Callable[[Group[T]], object],
        ack_messages: bool = False,
        *,
        on_error: ErrorHook[Group[T]] | None = None,
    ) -> None:
        policy = RoutePolicy(channels, route, flush_interval, f"MultipleQueueFlusher {name!r}")
        super().__init__(name, policy, processor=processor, batch_size=batch_size,
                         capacity=queue_size, workers=threads, ack_messages=ack_messages,
                         on_error=on_error)

    @property
    def channels(self) -> int:
        """The number of channels."""
        return len(self._channels)
