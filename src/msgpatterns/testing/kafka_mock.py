"""librdkafka's built-in mock Kafka cluster, for tests and examples without a server.

A client configured with ``test.mock.num.brokers`` starts an in-process cluster that
speaks the real Kafka protocol (produce, fetch, consumer groups, offset commits) and
logs the address it listens on. :class:`KafkaMockCluster` captures that address so any
number of clients (``KafkaBroker``, other processes) can connect to it.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

from msgpatterns._extras import require

__all__ = ["KafkaMockCluster"]

_ADDRESS = re.compile(r"Mock cluster enabled.*replaced with (\S+)")


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.address: str | None = None
        self.found = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        match = _ADDRESS.search(record.getMessage())
        if match:
            self.address = match.group(1).rstrip(",")
            self.found.set()


class KafkaMockCluster:
    """An in-process mock Kafka cluster; alive until :meth:`close` (or garbage
    collection). ``bootstrap_servers`` is its ``host:port`` list.

    Topics are created on first use (four partitions each).
    """

    def __init__(self, brokers: int = 1, timeout: float = 10.0) -> None:
        kafka = require("confluent_kafka", "kafka")
        capture = _Capture()
        self._logger = logging.getLogger(f"msgpatterns.kafka_mock.{id(self)}")
        self._logger.addHandler(capture)
        self._logger.setLevel(logging.DEBUG)
        self._logger.propagate = False
        self._owner: Any = kafka.Producer({
            "test.mock.num.brokers": brokers,
            "logger": self._logger,
        })
        self._owner.poll(0)
        if not capture.found.wait(timeout):
            raise RuntimeError("the librdkafka mock cluster did not report its address")
        assert capture.address is not None
        self.bootstrap_servers: str = capture.address

    @property
    def url(self) -> str:
        """A ``kafka://`` URL for ``msgpatterns dlq``."""
        return f"kafka://{self.bootstrap_servers}"

    def close(self) -> None:
        """Stop the cluster (its topics and offsets are gone)."""
        self._owner = None

    def __enter__(self) -> KafkaMockCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
