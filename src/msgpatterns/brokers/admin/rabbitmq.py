"""Moved to :mod:`msgpatterns.brokers.rabbitmq.admin`; this module re-exports it so that old imports
work."""

from __future__ import annotations

from msgpatterns.brokers.rabbitmq.admin import RabbitMQDeadLetters

__all__ = ["RabbitMQDeadLetters"]
