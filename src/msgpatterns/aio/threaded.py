"""Moved to :mod:`msgpatterns.brokers.threaded`; this module re-exports it so that old imports
work."""

from __future__ import annotations

from msgpatterns.brokers.threaded import ThreadedAsyncBroker

__all__ = ["ThreadedAsyncBroker"]
