"""Former home of :class:`~msgpatterns.testing.kafka_mock.KafkaMockCluster`, kept so old
imports work; import it from :mod:`msgpatterns.testing.kafka_mock`."""

from __future__ import annotations

from msgpatterns.testing.kafka_mock import KafkaMockCluster

__all__ = ["KafkaMockCluster"]
