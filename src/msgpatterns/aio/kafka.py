"""Moved to :mod:`msgpatterns.brokers.kafka.aio_threaded`; this module re-exports it so
that old imports work (``AsyncKafkaBroker`` too: :mod:`msgpatterns.brokers.kafka.aio`,
loaded on first use)."""

from __future__ import annotations

from typing import Any

from msgpatterns.brokers.kafka.aio_threaded import ThreadedAsyncKafkaBroker

__all__ = ["ThreadedAsyncKafkaBroker"]


def __getattr__(name: str) -> Any:
    # ``AsyncKafkaBroker`` (the default adapter) is the aiokafka one since it passed the
    # same conformance suite and measured faster; imported from here for compatibility.
    if name == "AsyncKafkaBroker":
        from msgpatterns.brokers.kafka.aio import AsyncKafkaBroker

        return AsyncKafkaBroker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
