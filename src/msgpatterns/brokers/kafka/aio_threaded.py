"""The asyncio Kafka adapters: :class:`ThreadedAsyncKafkaBroker` (here) and
:class:`~msgpatterns.brokers.kafka.aio.AIOKafkaBroker` (aiokafka); ``AsyncKafkaBroker``
is the default of the two: the aiokafka one, faster in ``benchmarks/bench_async_kafka.py``
with the same conformance suite green (docs/asyncio.md).

:class:`ThreadedAsyncKafkaBroker` is the sync :class:`~msgpatterns.brokers.KafkaBroker`
(confluent-kafka) run in worker threads - the mechanism of confluent-kafka's own asyncio API
(``confluent_kafka.aio``, which runs the sync client in an executor) - so the topics
(``T``, ``T.retry``, ``T.DLT``), the wire format, the offset tracking (never commit
past an unsettled record), the due-time pausing of retry partitions, rebalance handling
and every other guarantee are the sync adapter's, in one place. A message retried by
one is read by the other.

The constructor of :class:`ThreadedAsyncKafkaBroker` connects like the sync one (it may
block up to ``connect_timeout``): build it before the loop starts, or with ``await
asyncio.to_thread(ThreadedAsyncKafkaBroker, ...)``. (``AsyncKafkaBroker`` builds nothing
that connects until its first call, which awaits the connection on the loop.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from msgpatterns._callables import renamed_arguments
from msgpatterns.brokers.kafka.broker import KafkaBroker
from msgpatterns.brokers.threaded import ThreadedAsyncBroker

__all__ = ["ThreadedAsyncKafkaBroker"]


class ThreadedAsyncKafkaBroker(ThreadedAsyncBroker):
    """``ThreadedAsyncKafkaBroker(url, **options)``: the options of
    :class:`~msgpatterns.brokers.KafkaBroker`; :attr:`sync` is that broker (its
    dead-letter admin, ``commit``, ...)."""

    sync: KafkaBroker

    @renamed_arguments(bootstrap_or_config="url")
    def __init__(self, url: str | Mapping[str, Any], **options: Any) -> None:
        super().__init__(KafkaBroker(url, **options))

