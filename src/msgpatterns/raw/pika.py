"""Moved to :mod:`msgpatterns.brokers.rabbitmq.raw`; this module re-exports it so that old imports
work."""

from __future__ import annotations

from msgpatterns.brokers.rabbitmq.raw import PikaLoop

__all__ = ["PikaLoop"]
