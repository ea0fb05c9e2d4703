"""What the confluent-kafka parts of Kafka (the sync adapter, its admin and raw loop)
share: librdkafka's log, its errors as the library's own, the lifecycle that lets
``close()`` wait for the calls in progress, and a record as the wire core's
client-neutral :class:`~._records.RecordView`."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

from msgpatterns._extras import require
from msgpatterns.brokers.kafka._records import RecordView
from msgpatterns.errors import BrokerClosed, BrokerError, BrokerUnavailable

kafka = require("confluent_kafka", "kafka")

__all__ = ["Lifecycle", "LibrdkafkaLog", "kafka", "kafka_error", "rdkafka_log", "view"]

log = logging.getLogger("msgpatterns.brokers.kafka")

#: librdkafka's own log (connection attempts, ...), forwarded at DEBUG.
rdkafka_log = logging.getLogger("msgpatterns.brokers.kafka.librdkafka")

UNAVAILABLE_CODES = frozenset(
    getattr(kafka.KafkaError, name) for name in (
        "_TRANSPORT", "_ALL_BROKERS_DOWN", "_TIMED_OUT", "_MSG_TIMED_OUT", "_RESOLVE",
        "_TIMED_OUT_QUEUE", "NETWORK_EXCEPTION", "REQUEST_TIMED_OUT",
        "BROKER_NOT_AVAILABLE", "LEADER_NOT_AVAILABLE",
    ) if hasattr(kafka.KafkaError, name)
)


class LibrdkafkaLog:
    """The ``logger`` given to librdkafka: every line goes to :data:`rdkafka_log` at
    DEBUG (errors reach callers as exceptions, not as log spam on stderr)."""

    def log(self, level: int, msg: str, *args: Any) -> None:
        rdkafka_log.debug(msg, *args)


def kafka_error(exc: BaseException, what: str) -> BrokerError:
    """The library's error for a confluent-kafka exception (keep it as the cause)."""
    error = exc.args[0] if exc.args else None
    if isinstance(error, kafka.KafkaError):
        kind = BrokerUnavailable if error.code() in UNAVAILABLE_CODES else BrokerError
        return kind(f"Kafka {what} failed: {error.str()}")
    return BrokerError(f"Kafka {what} failed: {exc}")


class Lifecycle:
    """Open until :meth:`close`; counts the operations in progress so that close can
    wait for them (librdkafka handles must not be closed under a running call)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self.closed = False

    @contextlib.contextmanager
    def operation(self, what: str) -> Iterator[None]:
        with self._cond:
            if self.closed:
                raise BrokerClosed(f"KafkaBroker.{what}: the broker is closed")
            self._active += 1
        try:
            yield
        except kafka.KafkaException as exc:
            raise kafka_error(exc, what) from exc
        finally:
            with self._cond:
                self._active -= 1
                if not self._active:
                    self._cond.notify_all()

    def close(self, timeout: float) -> bool:
        """Refuse new operations and wait up to ``timeout`` for those in progress.
        False when already closed."""
        with self._cond:
            if self.closed:
                return False
            self.closed = True
            if not self._cond.wait_for(lambda: self._active == 0, timeout):
                log.warning("KafkaBroker.close: operations still running after %gs",
                            timeout)
            return True


def view(record: Any) -> RecordView:
    """A confluent-kafka record as the adapters' client-neutral record."""
    stamp = record.timestamp()
    return RecordView(record.topic(), record.partition(), record.offset(), record.key(),
                      record.value(), tuple(record.headers() or ()),
                      stamp[1] if stamp[1] > 0 else None)
