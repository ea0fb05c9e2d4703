"""Header names msgpatterns writes on messages to keep retry state durable.

Brokers that republish a message for a retry (RabbitMQ, Kafka) carry these headers, so
the attempt count and the first failure time survive a redelivery and a consumer
restart. Brokers with a native delivery count (Redis Streams, the in-memory fake) use
that count instead of :data:`ATTEMPT`.

Anyone who can publish can set these headers, so an adapter never trusts them:
:func:`header_problem` says what is wrong with a message's library headers (a number
that is not one, ``inf``/``nan``, an attempt below 1 or beyond :data:`MAX_ATTEMPT`, a
due time further out than :data:`MAX_RETRY_DELAY`), and every adapter dead-letters that
one message with the reason instead of stalling, hiding or mis-counting it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = [
    "ATTEMPT",
    "DEAD_LETTER_REASON",
    "ERROR_MESSAGE",
    "ERROR_TYPE",
    "FIRST_FAILED_AT",
    "LAST_FAILED_AT",
    "MAX_ATTEMPT",
    "MAX_RETRY_DELAY",
    "ORIGINAL_OFFSET",
    "ORIGINAL_PARTITION",
    "ORIGINAL_TOPIC",
    "RETRY_DUE_AT",
    "header_float",
    "header_int",
    "header_problem",
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
# The original publish time of a re-published message (a transport header).
_TIMESTAMP = PREFIX + "timestamp"

#: The highest attempt number a message may carry on the wire. The runtime never
#: writes more than ``RetryPolicy.max_attempts``; a larger one is a forged header.
MAX_ATTEMPT = 10_000
#: How far out a retry's due time may lie, in seconds (7 days): the library writes
#: ``now + delay`` with the delay of a retry policy or ``NeedRetry(delay)``; a due time
#: further out would hide the message (a forged header, or a clock gone wrong).
MAX_RETRY_DELAY = 7 * 86_400.0

_INTEGERS = (ATTEMPT, ORIGINAL_PARTITION, ORIGINAL_OFFSET)
_NUMBERS = (_TIMESTAMP, RETRY_DUE_AT, FIRST_FAILED_AT, LAST_FAILED_AT)


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


def header_problem(headers: Mapping[str, str], *, now: float | None = None,
                   max_attempt: int = MAX_ATTEMPT,
                   max_delay: float = MAX_RETRY_DELAY) -> str | None:
    """What is wrong with the library's own headers in ``headers`` (string values), or
    None when they are usable: an integer header (attempt, original partition and
    offset) that is not an integer, a time header that is not a finite number, an
    attempt outside ``1..max_attempt``, or - when ``now`` is given - a retry due time
    more than ``max_delay`` seconds after ``now``.

    Guarantees: never raises; the text names the header and quotes at most 50
    characters of its value (it is producer data), so an adapter can put it in the
    dead-letter reason of that one message. Other headers are not looked at.
    """
    for name in _INTEGERS + _NUMBERS:
        raw = headers.get(name)
        if raw is None:
            continue
        value = str(raw)
        number: float
        try:
            number = int(value) if name in _INTEGERS else float(value)
        except ValueError:
            kind = "an integer" if name in _INTEGERS else "a number"
            return f"header {name} is not {kind}: {value[:50]!r}"
        if not math.isfinite(number):
            return f"header {name} is out of range: {value[:50]!r}"
        if name == ATTEMPT and not 1 <= number <= max_attempt:
            return (f"header {name} is out of range: {value[:50]!r} (an attempt is "
                    f"1..{max_attempt})")
        if name == RETRY_DUE_AT and now is not None and number - now > max_delay:
            return (f"header {name} is out of range: {value[:50]!r} is more than "
                    f"{max_delay:g} s after now ({now:.3f})")
    return None
