"""The producing side of :class:`~msgpatterns.brokers.kafka.broker.KafkaBroker`: one
record handed to the producer (its local queue full: serve delivery reports and try
again) and, for retries, dead letters and publishes, waited for until the cluster
confirmed it. A part of the adapter: its state is the adapter's."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from msgpatterns.brokers.kafka._link import kafka, kafka_error
from msgpatterns.errors import BrokerUnavailable

__all__ = ["Producing"]


class Producing:
    """Produce and wait for the delivery report (see the module docstring)."""

    delivery_timeout: float
    _producer: Any

    def produce(self, topic: str, value: bytes | None, key: str | None,
                headers: Mapping[str, str]) -> tuple[int, int]:
        """Produce one record with ``headers`` and wait until the cluster confirmed it
        (``delivery_timeout``); its (partition, offset). A step of the dead-letter
        admin (replays, removal markers)."""
        return self._produce(topic, value, key, headers)

    def _produce(self, topic: str, value: bytes | None, key: str | None,
                 headers: Mapping[str, str],
                 extra: Sequence[tuple[str, Any]] = ()) -> tuple[int, int]:
        """Produce one record (``extra``: raw header pairs appended as they are) and
        wait for its delivery report; (partition, offset)."""
        outcome: dict[str, Any] = {}
        done = threading.Event()

        def on_delivery(error: Any, produced: Any) -> None:
            outcome["error"], outcome["record"] = error, produced
            done.set()

        self._send(topic, value, key, headers, on_delivery, extra)
        give_up = time.monotonic() + self.delivery_timeout
        while not done.is_set():
            if time.monotonic() > give_up:
                raise BrokerUnavailable(f"Kafka produce to {topic}: no delivery report "
                                        f"within {self.delivery_timeout:g}s")
            self._producer.poll(0.05)
        if outcome["error"] is not None:
            raise kafka_error(kafka.KafkaException(outcome["error"]), f"produce to {topic}")
        produced = outcome["record"]
        return produced.partition(), produced.offset()


    def _send(self, topic: str, value: bytes | None, key: str | None,
              headers: Mapping[str, str], on_delivery: Any,
              extra: Sequence[tuple[str, Any]] = ()) -> None:
        """Hand one record to the producer; while its local queue is full, serve
        delivery reports and try again (until ``delivery_timeout``)."""
        give_up = time.monotonic() + self.delivery_timeout
        while True:
            try:
                self._producer.produce(
                    topic, value=value, key=None if key is None else key.encode("utf-8"),
                    headers=[*headers.items(), *extra], on_delivery=on_delivery,
                )
                return
            except BufferError as exc:
                if time.monotonic() > give_up:
                    raise BrokerUnavailable(f"Kafka produce to {topic}: the producer "
                                            f"queue stayed full for "
                                            f"{self.delivery_timeout:g}s") from exc
                self._producer.poll(0.05)
