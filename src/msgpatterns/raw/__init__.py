"""Carry out a settlement decision in a loop you own (a redis-py XREADGROUP loop, a
confluent-kafka poll loop, a pika ``basic_consume`` callback).

:func:`msgpatterns.settlement.run_handler` turns a handler call into a decision
(:class:`~msgpatterns.settlement.Ack`, :class:`~msgpatterns.settlement.RetryLater`,
:class:`~msgpatterns.settlement.DeadLetterIt`); the per-client helpers here carry it out
on the broker with the adapter's own topology and wire format:

* :class:`msgpatterns.brokers.redis.raw.RedisLoop` - ``S:retry:G``, ``S:delayed:G``, ``S:dlq``;
* :class:`msgpatterns.brokers.kafka.raw.KafkaLoop` - ``T.retry``, ``T.DLT``, contiguous commits;
* :class:`msgpatterns.brokers.rabbitmq.raw.PikaLoop` - ``T.G.retry.<ms>`` TTL queues,
  ``<queue>.dlq``.

So a message retried by a raw loop and one retried by the
:class:`~msgpatterns.Consumer` are interchangeable, the attempt count survives both, and
``msgpatterns dlq`` lists and replays the dead letters of both. Each helper is imported
from its own module (it loads its client library).
"""

from __future__ import annotations

from msgpatterns.brokers.loop import RawLoop, Settles, carry_out

__all__ = ["RawLoop", "Settles", "carry_out"]
