"""Exceptions a handler raises to steer delivery, and the library's own error types.

Handlers signal intent with three exceptions:

* :class:`NeedRetry` - "not now": retried in-process first, then redelivered later.
* :class:`InProgress` - another consumer holds the idempotency lease for this key.
* :class:`Reject` - "never": the message goes straight to the dead-letter store.

Anything else is an ordinary failure handled by the :class:`~msgpatterns.RetryPolicy`.
"""

from __future__ import annotations

from datetime import timedelta

__all__ = [
    "AckTimeout",
    "ConfigurationError",
    "IdempotencyConflict",
    "InProgress",
    "MalformedMessage",
    "MissingExtra",
    "MsgPatternsError",
    "NeedRetry",
    "QueueClosed",
    "Reject",
    "StoreUnavailable",
    "seconds",
]


def seconds(value: float | timedelta | None) -> float | None:
    """Return ``value`` in seconds; ``timedelta`` and numbers are both accepted."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        return value.total_seconds()
    result = float(value)
    if result < 0:
        raise ValueError(f"a duration cannot be negative: {value!r}")
    return result


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


class AckTimeout(MsgPatternsError):
    """A message was not acknowledged before its ``ack_timeout`` deadline."""


class StoreUnavailable(MsgPatternsError):
    """A backing store (Redis, SQL, ...) could not be reached after retries."""


class QueueClosed(MsgPatternsError):
    """An item was added to a batching queue after ``close()``."""


class ConfigurationError(MsgPatternsError, ValueError):
    """An argument or combination of arguments is invalid."""


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""

    def __init__(self, extra: str, package: str) -> None:
        super().__init__(
            f"{package} is required for this feature: pip install 'msgpatterns[{extra}]'"
        )
        self.extra = extra
        self.package = package
