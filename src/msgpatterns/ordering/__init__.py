"""Ordering and concurrent updates: out-of-order messages, racing writers, per-key order.

* :class:`VersionGuard` - version-checked writes to a SQL table: strict transitions
  (``apply``) and latest-wins upserts (``upsert_latest``, ``upsert_latest_many``).
* :func:`optimistic_update` - read-merge-write with a compare-and-set and local retries
  (:func:`async_optimistic_update` for coroutines).
* :class:`OrderedExecutor` - per-key FIFO execution across resizable lanes.
* :class:`OrderedTopic` - per-key order across processes over logic partitions and
  versioned routes: split, merge and move physical partitions without breaking it;
  routes in a :class:`SqlRouteStore`, :class:`RedisRouteStore` or
  :class:`MemoryRouteStore`.

``VersionGuard`` and ``SqlRouteStore`` need the ``[sql]`` extra (SQLAlchemy),
``RedisRouteStore`` the ``[redis]`` extra; they are imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from msgpatterns.ordering.errors import (
    InvalidVersion,
    MissingVersion,
    RouteConflict,
    RouteError,
    VersionConflict,
)
from msgpatterns.ordering.executor import OrderedExecutor
from msgpatterns.ordering.optimistic import async_optimistic_update, optimistic_update
from msgpatterns.ordering.partitions import Key, key_bytes, lane_ranges, logic_partition
from msgpatterns.ordering.route_store import MemoryRouteStore, RouteStore, TopicState
from msgpatterns.ordering.routes import Route, Segment
from msgpatterns.ordering.topic import OrderedTopic

if TYPE_CHECKING:
    from msgpatterns.ordering.redis_routes import RedisRouteStore
    from msgpatterns.ordering.sql_routes import SqlRouteStore
    from msgpatterns.ordering.version_guard import VersionGuard

__all__ = [
    "InvalidVersion",
    "Key",
    "MemoryRouteStore",
    "MissingVersion",
    "OrderedExecutor",
    "OrderedTopic",
    "RedisRouteStore",
    "Route",
    "RouteConflict",
    "RouteError",
    "RouteStore",
    "Segment",
    "SqlRouteStore",
    "TopicState",
    "VersionConflict",
    "VersionGuard",
    "key_bytes",
    "lane_ranges",
    "logic_partition",
    "async_optimistic_update",
    "optimistic_update",
]


_LAZY = {
    "VersionGuard": "msgpatterns.ordering.version_guard",
    "SqlRouteStore": "msgpatterns.ordering.sql_routes",
    "RedisRouteStore": "msgpatterns.ordering.redis_routes",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'msgpatterns.ordering' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
