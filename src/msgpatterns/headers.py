"""Header names msgpatterns writes on messages to keep retry state durable.

Brokers that republish a message for a retry (RabbitMQ, Kafka) carry these headers, so
the attempt count and the first failure time survive a redelivery and a consumer
restart. Brokers with a native delivery count (Redis Streams, the in-memory fake) use
that count instead of :data:`ATTEMPT`.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "ATTEMPT",
    "DEAD_LETTER_REASON",
    "ERROR_MESSAGE",
    "ERROR_TYPE",
    "FIRST_FAILED_AT",
    "LAST_FAILED_AT",
    "ORIGINAL_OFFSET",
    "ORIGINAL_PARTITION",
    "ORIGINAL_TOPIC",
    "RETRY_DUE_AT",
    "header_float",
    "header_int",
]

PREFIX = "x-msgpatterns-"
ATTEMPT = PREFIX + "attempt"
FIRST_FAILED_AT = PREFIX + "first-failed-at"
LAST_FAILED_AT = PREFIX + "last-failed-at"
ERROR_TYPE = PREFIX + "error-type"
ERROR_MESSAGE = PREFIX + "error-message"
DEAD_LETTER_REASON = PREFIX + "dead-letter-reason"
RETRY_DUE_AT = PREFIX + "retry-due-at"
ORIGINAL_TOPIC = PREFIX + "original-topic"
ORIGINAL_PARTITION = PREFIX + "original-partition"
ORIGINAL_OFFSET = PREFIX + "original-offset"


def header_int(headers: Mapping[str, str], name: str, default: int) -> int:
    """An integer header, or ``default`` when it is absent or not an integer."""
    try:
        return int(headers[name])
    except (KeyError, TypeError, ValueError):
        return default


def header_float(headers: Mapping[str, str], name: str) -> float | None:
    """A float header, or None when it is absent or not a number."""
    try:
        return float(headers[name])
    except (KeyError, TypeError, ValueError):
        return None
