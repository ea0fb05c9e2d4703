"""Exceptions a handler raises to steer delivery, and the library's own error types.

Handlers signal intent with three exceptions:

* :class:`NeedRetry` - "not now": retried in-process first, then redelivered later.
* :class:`InProgress` - another consumer holds the idempotency lease for this key.
* :class:`Reject` - "never": the message goes straight to the dead-letter store.

Anything else is an ordinary failure handled by the :class:`~msgpatterns.RetryPolicy`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from msgpatterns.message import Message

__all__ = [
    "AckTimeout",
    "BrokerClosed",
    "BrokerError",
    "BrokerUnavailable",
    "ClosedError",
    "ConfigurationError",
    "IdempotencyConflict",
    "InProgress",
    "MalformedMessage",
    "MissingExtra",
    "MsgPatternsError",
    "NeedRetry",
    "PartialFailure",
    "QueueClosed",
    "Reject",
    "StoreUnavailable",
    "UnroutableError",
    "describe",
    "printable",
    "seconds",
]


#: The longest duration msgpatterns accepts anywhere (100 years): larger values are
#: mistakes, and would overflow broker timestamps and timer arithmetic.
MAX_DURATION = 100 * 365 * 86400.0


def seconds(value: float | timedelta | None) -> float | None:
    """Return ``value`` in seconds; ``timedelta`` and numbers are both accepted.

    Guarantees: the result is ``None`` (for ``None``) or a finite float in
    ``[0, MAX_DURATION]``; a negative, NaN, infinite or absurdly large duration, in any
    form, raises :class:`ConfigurationError` (a ``ValueError``).
    """
    if value is None:
        return None
    if isinstance(value, timedelta):
        result = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(
            f"a duration must be seconds (int or float) or a timedelta, got {value!r}"
        )
    else:
        result = float(value)
    if math.isnan(result) or result < 0:
        raise ConfigurationError(f"a duration cannot be negative or NaN: {value!r}")
    if result > MAX_DURATION:
        raise ConfigurationError(
            f"a duration must be finite and at most {MAX_DURATION:g}s: {value!r}"
        )
    return result


def printable(text: str) -> str:
    """``text`` with lone surrogates (from ``surrogateescape``-decoded bytes) escaped,
    so every encoder (UTF-8 headers, JSON, logs) accepts it."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def describe(error: BaseException | None) -> str:
    """The text of ``error`` that never raises: ``str(error)``, or a fallback naming
    the type when ``__str__`` itself fails; always encodable as UTF-8."""
    if error is None:
        return ""
    try:
        text = str(error)
    except BaseException as failure:
        try:
            text = f"<{type(error).__qualname__}: str() raised {type(failure).__qualname__}>"
        except BaseException:
            text = "<error whose str() raised>"
    return printable(text)


class MsgPatternsError(Exception):
    """Base class of every error msgpatterns raises itself."""


class NeedRetry(MsgPatternsError):
    """Ask for this message to be processed again.

    Without ``delay`` the runtime retries in-process first (``message.local_retries`` is
    incremented) up to ``RetryPolicy.local_retries`` times with a short backoff, then
    falls back to a delayed redelivery. With ``delay`` (seconds or ``timedelta``) the
    message is redelivered after that delay. A ``NeedRetry`` is expected control flow:
    it is never logged as an error.
    """

    def __init__(self, delay: float | timedelta | None = None, reason: str = "") -> None:
        self.delay: float | None = seconds(delay)
        self.reason = reason
        text = reason or type(self).__name__
        if self.delay is not None:
            text = f"{text} (retry in {self.delay:g}s)"
        super().__init__(text)


class InProgress(NeedRetry):
    """Another consumer holds the idempotency lease for this message's key.

    The delay defaults to the remaining time of that lease, so the duplicate comes back
    when the owner has either finished (it will then be skipped) or died (it will then
    take over).
    """


class Reject(MsgPatternsError):
    """The message can never succeed: send it straight to the dead-letter store."""

    def __init__(self, reason: str = "") -> None:
        self.reason = reason
        super().__init__(reason or type(self).__name__)


class MalformedMessage(Reject):
    """The message body or a required field could not be decoded or is missing."""


class IdempotencyConflict(Reject):
    """The same idempotency key arrived with a different payload fingerprint."""


class PartialFailure(MsgPatternsError):
    """Raised by a batch handler (``Consumer(..., batch=True)``): the messages in
    ``failures`` failed, each with its exception (``NeedRetry``, ``Reject``, any error:
    each goes through the retry policy on its own); every other message of the batch
    succeeded. ``message.ack(error)`` inside the handler does the same for one message.
    """

    def __init__(self, failures: Mapping[Message, BaseException]) -> None:
        self.failures: dict[Message, BaseException] = dict(failures)
        for error in self.failures.values():
            if not isinstance(error, BaseException):
                raise TypeError(
                    f"PartialFailure maps messages to exception instances, got {error!r}")
        super().__init__(f"{len(self.failures)} message(s) of the batch failed")


class AckTimeout(MsgPatternsError):
    """A message was not acknowledged before its ``ack_timeout`` deadline."""


class StoreUnavailable(MsgPatternsError):
    """A backing store (Redis, SQL, ...) could not be reached after retries."""


class ClosedError(MsgPatternsError, RuntimeError):
    """A part was used after ``close()`` (or ``stop()`` / ``shutdown()``): a timing
    wheel, an ordered executor, a batching queue. A ``RuntimeError``, as the standard
    library's executors raise after shutdown. Brokers raise :class:`BrokerClosed`."""


class QueueClosed(ClosedError):
    """An item was added to a batching queue after ``close()``."""


class ConfigurationError(MsgPatternsError, ValueError, TypeError):
    """An argument or combination of arguments is invalid: a misuse, raised when the
    part is built (or decorated) whenever the mistake is visible then.

    It is both a ``ValueError`` and a ``TypeError``, the two built-in exceptions Python
    code raises for a bad argument, so ``except ValueError`` and ``except TypeError``
    written against earlier releases (or against the standard library's habits) keep
    catching it."""


class BrokerError(MsgPatternsError):
    """A broker operation failed; the client library's own exception is the cause."""


class BrokerClosed(BrokerError):
    """The broker adapter was closed: every operation after ``close()`` raises this."""


class BrokerUnavailable(BrokerError):
    """The broker could not be reached (after the adapter's reconnect attempts)."""


class UnroutableError(BrokerError):
    """A publish could not be routed to any queue; nothing was sent."""


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""

    def __init__(self, extra: str, package: str) -> None:
        super().__init__(
            f"{package} is required for this feature: pip install 'msgpatterns[{extra}]'"
        )
        self.extra = extra
        self.package = package
