"""Ordering and concurrent updates: out-of-order messages, racing writers, per-key order.

* :class:`VersionGuard` - version-checked writes to a SQL table: strict transitions
  (``apply``) and latest-wins upserts (``upsert_latest``, ``upsert_latest_many``).
* :func:`optimistic_update` - read-merge-write with a compare-and-set and local retries
  (:func:`async_optimistic_update` for coroutines).
* :class:`OrderedExecutor` - per-key FIFO execution across resizable lanes.

``VersionGuard`` needs the ``[sql]`` extra (SQLAlchemy); it is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from msgpatterns.ordering.errors import InvalidVersion, MissingVersion, VersionConflict
from msgpatterns.ordering.executor import OrderedExecutor
from msgpatterns.ordering.optimistic import async_optimistic_update, optimistic_update
from msgpatterns.ordering.partitions import Key, key_bytes, lane_ranges, logic_partition

if TYPE_CHECKING:
    from msgpatterns.ordering.version_guard import VersionGuard

__all__ = [
    "InvalidVersion",
    "Key",
    "MissingVersion",
    "OrderedExecutor",
    "VersionConflict",
    "VersionGuard",
    "key_bytes",
    "lane_ranges",
    "logic_partition",
    "async_optimistic_update",
    "optimistic_update",
]


def __getattr__(name: str) -> Any:
    if name == "VersionGuard":
        from msgpatterns.ordering.version_guard import VersionGuard

        globals()[name] = VersionGuard
        return VersionGuard
    raise AttributeError(f"module 'msgpatterns.ordering' has no attribute {name!r}")
