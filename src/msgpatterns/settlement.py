"""Settling one delivery: the outcome of a handler call becomes a typed decision.

This is the settlement rule the :class:`~msgpatterns.Consumer` follows, offered to code
that owns its loop (a pika ``basic_consume`` callback, a confluent-kafka poll loop, a
redis-py XREADGROUP loop, a framework's subscriber). Give it the delivery (with its
durable ``attempt``) and what the handler did (returned, or raised), and it answers
with one of:

* :class:`Ack` - done (success, or a duplicate skipped by ``@idempotent``);
* :class:`RetryNow` - try again in-process after ``delay`` seconds (``NeedRetry()``
  without a delay, up to ``RetryPolicy.local_retries``);
* :class:`RetryLater` - redeliver after ``delay`` seconds, with ``headers`` (the
  message's headers plus the failure history and the next attempt number) on the copy;
* :class:`DeadLetterIt` - park it with the full :class:`~msgpatterns.DeadLetter`.

The decision itself is :meth:`RetryPolicy.decide`: one place for the Consumer, raw
loops and integrations alike. :func:`run_handler` adds the in-process retries, so a
raw loop needs one call per delivery.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from msgpatterns import headers as h
from msgpatterns.deadletter import DeadLetter, DeadLetterStore
from msgpatterns.errors import ConfigurationError, describe
from msgpatterns.message import Message
from msgpatterns.retry import Action, RetryPolicy

__all__ = [
    "Ack",
    "DeadLetterIt",
    "Decision",
    "RetryLater",
    "RetryNow",
    "checked_policy_and_store",
    "failure_headers",
    "run_handler",
    "settle",
]


@dataclass(frozen=True, slots=True)
class Ack:
    """The delivery is done: acknowledge it."""

    result: Any = None


@dataclass(frozen=True, slots=True)
class RetryNow:
    """Run the handler again in this process after ``delay`` seconds."""

    delay: float
    error: BaseException


@dataclass(frozen=True, slots=True)
class RetryLater:
    """Redeliver after ``delay`` seconds; the copy carries ``headers`` (attempt + 1 and
    the failure history), so the attempt count survives the redelivery."""

    delay: float
    error: BaseException
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def attempt(self) -> int:
        """The attempt number the redelivered copy will have."""
        return h.header_int(self.headers, h.ATTEMPT, 1)


@dataclass(frozen=True, slots=True)
class DeadLetterIt:
    """Give up: park the message with ``record`` (body, headers, attempts, failure
    times, error type, text and traceback, reason) and acknowledge the delivery."""

    record: DeadLetter

    @property
    def reason(self) -> str:
        return self.record.reason


Decision = Ack | RetryNow | RetryLater | DeadLetterIt


def failure_headers(headers: Mapping[str, str], error: BaseException,
                    now: float) -> dict[str, str]:
    """``headers`` plus the failure history a redelivery carries: first and last
    failure time (the first is kept), the error's type and text (never raises)."""
    out = dict(headers)
    stamp = repr(float(now))
    out.setdefault(h.FIRST_FAILED_AT, stamp)
    out[h.LAST_FAILED_AT] = stamp
    out[h.ERROR_TYPE] = type(error).__name__
    out[h.ERROR_MESSAGE] = describe(error)[:500]
    return out


def settle(message: Message, error: BaseException | None, *, policy: RetryPolicy,
           now: float | None = None, group: str = "", result: Any = None) -> Decision:
    """The decision for ``message`` whose handler call ended with ``error`` (None: it
    returned ``result``). ``now`` is the broker's clock (default: wall time)."""
    verdict = policy.decide(message, error)
    if verdict.action is Action.ACK:
        return Ack(result)
    assert error is not None
    when = time.time() if now is None else now
    if verdict.action is Action.RETRY_LOCALLY:
        return RetryNow(verdict.delay, error)
    if verdict.action is Action.REDELIVER:
        copy = failure_headers(message.headers, error, when)
        copy[h.ATTEMPT] = str(message.attempt + 1)
        return RetryLater(verdict.delay, error, copy)
    record = DeadLetter.from_error(message, error, now=when, reason=verdict.reason,
                                   group=group)
    return DeadLetterIt(record)


def run_handler(handler: Callable[[Message], Any], message: Message, *,
                policy: RetryPolicy, now: Callable[[], float] = time.time,
                sleep: Callable[[float], None] = time.sleep, group: str = "") -> Decision:
    """Call ``handler(message)``, retrying in-process as the policy allows, and return
    the final decision (never :class:`RetryNow`). Exceptions are outcomes: none
    escapes, except ``KeyboardInterrupt`` and ``SystemExit``, which stop the loop."""
    while True:
        error: BaseException | None = None
        result: Any = None
        try:
            result = handler(message)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:
            error = exc
        decision = settle(message, error, policy=policy, now=now(), group=group,
                          result=result)
        if not isinstance(decision, RetryNow):
            return decision
        sleep(decision.delay)
        message.local_retries += 1


def checked_policy_and_store(policy: RetryPolicy | None, dead_letters: DeadLetterStore | None
                             ) -> tuple[RetryPolicy, DeadLetterStore | None]:
    """The retry policy (a default one for None) and the dead-letter store an
    integration settles with; ConfigurationError for anything else."""
    if policy is not None and not isinstance(policy, RetryPolicy):
        raise ConfigurationError(f"policy must be a RetryPolicy, got {policy!r}")
    if dead_letters is not None and not callable(getattr(dead_letters, "put", None)):
        raise ConfigurationError(
            f"dead_letters must be a DeadLetterStore (with put), got {dead_letters!r}")
    return (policy if policy is not None else RetryPolicy()), dead_letters
