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

Those limits are the library's; the consumer's own :class:`~msgpatterns.RetryPolicy`
is tighter (:meth:`~msgpatterns.RetryPolicy.wire_bounds` gives a :class:`WireBounds`):
:func:`trusted_attempt` ignores an attempt header beyond it (the count restarts, so a
forged count cannot skip the retries the policy grants) and :func:`honoured_due_at`
treats a due time beyond it as due now (so it cannot hide a message longer than the
policy's longest delay). Every adapter reads attempts and due times through these two.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "ATTEMPT",
    "CLOCK_SKEW",
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
    "WIRE_LIMITS",
    "WireBounds",
    "header_float",
    "header_int",
    "header_problem",
    "honoured_due_at",
    "trusted_attempt",
]

log = logging.getLogger("msgpatterns.headers")

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
#: How far a writer's clock may run ahead of a reader's, in seconds: a due time up to
#: this much beyond a policy's longest delay is still honoured.
CLOCK_SKEW = 60.0


@dataclass(frozen=True, slots=True)
class WireBounds:
    """How much of the library's headers on an incoming message a consumer trusts.

    Attributes:
        max_attempt: the largest ``x-msgpatterns-attempt`` taken as a count of earlier
            attempts; a larger one is ignored (:func:`trusted_attempt`).
        max_delay: the longest retry delay the consumer writes, in seconds; a
            ``x-msgpatterns-retry-due-at`` further out than this plus
            :data:`CLOCK_SKEW` is taken as due now (:func:`honoured_due_at`).

    :meth:`msgpatterns.RetryPolicy.wire_bounds` makes them from a consumer's policy;
    :data:`WIRE_LIMITS` (the library's limits) applies where no policy is known.
    """

    max_attempt: int = MAX_ATTEMPT
    max_delay: float = MAX_RETRY_DELAY

    def widest(self, other: WireBounds) -> WireBounds:
        """The looser of two bounds, field by field (two consumers of one group with
        different policies: what either of them writes is trusted)."""
        return WireBounds(max(self.max_attempt, other.max_attempt),
                          max(self.max_delay, other.max_delay))


#: The library's own limits (no consumer policy known).
WIRE_LIMITS = WireBounds()

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


def trusted_attempt(headers: Mapping[str, str], bounds: WireBounds = WIRE_LIMITS) -> int:
    """The attempt number ``x-msgpatterns-attempt`` in ``headers`` stands for, as far as
    ``bounds`` trust it: the header when it is an integer in ``1..bounds.max_attempt``,
    else 1 (absent, not a number, or beyond what the consumer's policy writes: a forged
    or foreign count is not evidence of earlier attempts, so the message gets the
    retries its policy grants). A broker's native delivery count is added by the
    caller (:func:`msgpatterns.brokers.codec.attempt_of`), never bounded here.

    Guarantees: never raises; the result is in ``1..max(1, bounds.max_attempt)``; an
    ignored count above the bound is logged (a warning naming the header, the value
    and the bound)."""
    attempt = header_int(headers, ATTEMPT, 1)
    if 1 <= attempt <= bounds.max_attempt:
        return attempt
    if attempt > bounds.max_attempt:
        log.warning("header %s=%d is above this consumer's bound %d (2 x max_attempts):"
                    " ignored, the attempts count from 1", ATTEMPT, attempt,
                    bounds.max_attempt)
    return 1


def honoured_due_at(due_at: float | None, now: float,
                    bounds: WireBounds = WIRE_LIMITS) -> float | None:
    """When a retry carrying ``x-msgpatterns-retry-due-at: due_at`` is to be delivered,
    seen at ``now``: ``due_at`` itself while it lies in the future by at most
    ``bounds.max_delay`` plus :data:`CLOCK_SKEW`; None (deliver now) when there is no
    due time, when it has passed, or when it is not a finite number or lies further
    out than the consumer's policy ever writes - such a due time would hide the
    message longer than the policy would (holding it until a bound instead would not
    help: each later look sees the same far due time).

    Guarantees: never raises; a result is never more than ``bounds.max_delay +
    CLOCK_SKEW`` seconds after ``now``; a due time taken as due now for being too far
    out is logged (a warning naming the header and the bound)."""
    if due_at is None or not math.isfinite(due_at) or due_at <= now:
        return None
    if due_at - now <= bounds.max_delay + CLOCK_SKEW:
        return due_at
    log.warning("header %s is %.0f s ahead, beyond this consumer's longest retry delay"
                " (%g s + %g s clock skew): due now", RETRY_DUE_AT, due_at - now,
                bounds.max_delay, CLOCK_SKEW)
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
