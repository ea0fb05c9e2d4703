"""Moved to :mod:`msgpatterns.brokers.memory.admin`; this module re-exports it so that old imports
work."""

from __future__ import annotations

from msgpatterns.brokers.memory.admin import InMemoryDeadLetters

__all__ = ["InMemoryDeadLetters"]
