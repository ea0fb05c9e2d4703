"""Batching helpers that turn single messages into batch writes.

* :class:`BatchExecutor` - no waiting: batches grow only when the processor falls behind.
* :class:`Flusher` - a batch goes out when full or when its oldest item has waited
  ``flush_interval``.
* :class:`MultipleQueueFlusher` - a Flusher per channel (shard, table); the processor
  gets a :class:`Group` of one channel.

All three share ``add(item, timeout=None) -> bool``, ``flush()``, ``close(timeout)``,
context-manager use, :class:`BatchCounters` and ``ack_messages`` (see
:mod:`msgpatterns.batching.core` for the guarantees).
"""

from msgpatterns.batching.core import BatchCounters, BatchQueue
from msgpatterns.batching.executor import BatchExecutor
from msgpatterns.batching.flusher import Flusher
from msgpatterns.batching.multiple import Group, MultipleQueueFlusher, RouteError

__all__ = [
    "BatchCounters",
    "BatchExecutor",
    "BatchQueue",
    "Flusher",
    "Group",
    "MultipleQueueFlusher",
    "RouteError",
]
