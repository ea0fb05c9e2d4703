"""Moved to :mod:`msgpatterns.brokers.admin` (kept for imports of the old path)."""

from __future__ import annotations

from msgpatterns.brokers.admin.base import DeadLetterAdmin, selected

__all__ = ["DeadLetterAdmin", "selected"]
