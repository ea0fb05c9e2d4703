"""Kafka: the sync adapter (confluent-kafka), the asyncio adapters (aiokafka, and the
sync one in threads), the dead-letter admin and the raw-loop helper, one module each
(``broker``, ``aio``, ``aio_threaded``, ``admin``, ``raw``).

Names load on first use (they need the ``[kafka]`` extra). This package is also the
former module ``msgpatterns.brokers.kafka``: its names still import from here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from msgpatterns._extras import lazy_attributes

if TYPE_CHECKING:
    from msgpatterns.brokers.kafka._link import kafka as kafka
    from msgpatterns.brokers.kafka._records import OffsetTracker as OffsetTracker
    from msgpatterns.brokers.kafka._records import bootstrap_servers as bootstrap_servers
    from msgpatterns.brokers.kafka.admin import KafkaDeadLetters
    from msgpatterns.brokers.kafka.aio import AIOKafkaBroker, AsyncKafkaBroker
    from msgpatterns.brokers.kafka.aio_threaded import ThreadedAsyncKafkaBroker
    from msgpatterns.brokers.kafka.broker import KafkaBroker
    from msgpatterns.brokers.kafka.raw import KafkaLoop

__all__ = ["AIOKafkaBroker", "AsyncKafkaBroker", "KafkaBroker", "KafkaDeadLetters",
           "KafkaLoop", "ThreadedAsyncKafkaBroker"]

__getattr__ = lazy_attributes(__name__, {
    "KafkaBroker": "msgpatterns.brokers.kafka.broker",
    # the former module's names, still imported from here
    "kafka": "msgpatterns.brokers.kafka._link",
    "OffsetTracker": "msgpatterns.brokers.kafka._records",
    # ``host:port,...`` from a ``kafka://`` URL (the command line's check of a URL)
    "bootstrap_servers": "msgpatterns.brokers.kafka._records",
    "AIOKafkaBroker": "msgpatterns.brokers.kafka.aio",
    "AsyncKafkaBroker": "msgpatterns.brokers.kafka.aio",
    "ThreadedAsyncKafkaBroker": "msgpatterns.brokers.kafka.aio_threaded",
    "KafkaDeadLetters": "msgpatterns.brokers.kafka.admin",
    "KafkaLoop": "msgpatterns.brokers.kafka.raw",
})
