"""Moved to :mod:`msgpatterns.brokers.rabbitmq.aio`; this module re-exports it so that old imports
work."""

from __future__ import annotations

from msgpatterns.brokers.rabbitmq.aio import AsyncRabbitMQBroker

__all__ = ["AsyncRabbitMQBroker"]
