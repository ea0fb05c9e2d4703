"""RabbitMQ: the sync adapter (pika), the asyncio adapter (aio-pika), the dead-letter
admin and the raw-loop helper, one module each (``broker``, ``aio``, ``admin``,
``raw``).

Names load on first use (they need the ``[rabbitmq]`` extra). This package is also
the former module ``msgpatterns.brokers.rabbitmq``: its names still import from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgpatterns._extras import lazy_attributes

if TYPE_CHECKING:
    from msgpatterns.brokers.rabbitmq._link import coalesce_output as coalesce_output
    from msgpatterns.brokers.rabbitmq._link import pika as pika
    from msgpatterns.brokers.rabbitmq._link import pika_errors as pika_errors
    from msgpatterns.brokers.rabbitmq._link import url_parameters as url_parameters
    from msgpatterns.brokers.rabbitmq.admin import RabbitMQDeadLetters
    from msgpatterns.brokers.rabbitmq.aio import AsyncRabbitMQBroker
    from msgpatterns.brokers.rabbitmq.broker import MAX_DELAY_MS, RabbitMQBroker, delay_bucket_ms
    from msgpatterns.brokers.rabbitmq.raw import PikaLoop

__all__ = ["MAX_DELAY_MS", "AsyncRabbitMQBroker", "PikaLoop", "RabbitMQBroker",
           "RabbitMQDeadLetters", "delay_bucket_ms"]

__getattr__ = lazy_attributes(__name__, {
    "RabbitMQBroker": "msgpatterns.brokers.rabbitmq.broker",
    "MAX_DELAY_MS": "msgpatterns.brokers.rabbitmq.broker",
    "delay_bucket_ms": "msgpatterns.brokers.rabbitmq.broker",
    # the former module's helpers, still imported from here
    "coalesce_output": "msgpatterns.brokers.rabbitmq._link",
    "pika": "msgpatterns.brokers.rabbitmq._link",
    "pika_errors": "msgpatterns.brokers.rabbitmq._link",
    "url_parameters": "msgpatterns.brokers.rabbitmq._link",
    "AsyncRabbitMQBroker": "msgpatterns.brokers.rabbitmq.aio",
    "RabbitMQDeadLetters": "msgpatterns.brokers.rabbitmq.admin",
    "PikaLoop": "msgpatterns.brokers.rabbitmq.raw",
})
