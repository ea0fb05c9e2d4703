"""Exceptions a handler raises to steer delivery, and the library's own error types.

Handlers signal intent with three exceptions:

* :class:`NeedRetry` - "not now": retried in-process first, then redelivered later.
* :class:`InProgress` - another consumer holds the idempotency lease for this key.
* :class:`Reject` - "never": the message goes straight to the dead-letter store.

Anything else is an ordinary failure handled by the :class:`~msgpatterns.RetryPolicy`.

Every public error class of msgpatterns is defined here (the modules that raise them
re-export them under their former import paths), so ``from msgpatterns.errors import``
reaches all of them. The families:

* handler intent: :class:`NeedRetry` (:class:`InProgress`), :class:`Reject`
  (:class:`MalformedMessage` and its kinds, :class:`IdempotencyConflict`, the ordering
  rejects);
* misuse: :class:`ConfigurationError` (:class:`RouteError`, :class:`InvalidChannel`);
* a part used after ``close()``: :class:`ClosedError` (:class:`BrokerClosed`,
  :class:`CheckerClosed`, :class:`QueueClosed`);
* I/O: :class:`BrokerError` (:class:`BrokerClosed`, :class:`BrokerUnavailable`,
  :class:`UnroutableError`, :class:`PartialPublish`), :class:`StoreUnavailable`,
  :class:`TransactionAborted`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

__all__ = [
    "AckTimeout",
    "BrokerClosed",
    "BrokerError",
    "BrokerUnavailable",
    "CheckerClosed",
    "ClosedError",
    "ConfigurationError",
    "IdempotencyConflict",
    "InProgress",
    "InvalidChannel",
    "InvalidVersion",
    "KeyStopped",
    "MalformedMessage",
    "MessageTooLarge",
    "MissingExtra",
    "MissingIdempotencyKey",
    "MissingVersion",
    "MsgPatternsError",
    "NeedRetry",
    "PartialFailure",
    "PartialPublish",
    "QueueClosed",
    "Reject",
    "ResultIntegrityError",
    "ResultNotSerialisable",
    "ResultNotStored",
    "RouteConflict",
    "RouteError",
    "ScheduleFailure",
    "StoreUnavailable",
    "TransactionAborted",
    "UnroutableError",
    "UnroutedMessage",
    "VersionConflict",
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

    def __init__(self, failures: Mapping[Any, BaseException]) -> None:
        #: Message -> its exception (this module sits below msgpatterns.message).
        self.failures: dict[Any, BaseException] = dict(failures)
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
    """A part was used after ``close()`` (or ``stop()`` / ``shutdown()``): every closed
    part raises one at once and never reopens. A ``RuntimeError``, as the standard
    library's executors raise after shutdown.

    The base of the closed errors: a broker (or its dead-letter admin) raises
    :class:`BrokerClosed`, a checker :class:`CheckerClosed`, a batching queue
    :class:`QueueClosed`; a timing wheel, an ordered executor, a version guard and a
    closed ``Consumer`` / ``AsyncConsumer`` raise ``ClosedError`` itself. ``except
    ClosedError`` catches them all."""


class QueueClosed(ClosedError):
    """An item was added to a batching queue after ``close()``."""


class CheckerClosed(ClosedError):
    """A checker was used after its ``close()``: every operation raises this at once."""


class ConfigurationError(MsgPatternsError, ValueError, TypeError):
    """An argument or combination of arguments is invalid: a misuse, raised when the
    part is built (or decorated) whenever the mistake is visible then.

    It is both a ``ValueError`` and a ``TypeError``, the two built-in exceptions Python
    code raises for a bad argument, so ``except ValueError`` and ``except TypeError``
    written against earlier releases (or against the standard library's habits) keep
    catching it."""


class BrokerError(MsgPatternsError):
    """A broker operation failed; the client library's own exception is the cause."""


class BrokerClosed(BrokerError, ClosedError):
    """The broker adapter was closed: every operation after ``close()`` raises this.
    Both a :class:`BrokerError` and a :class:`ClosedError`."""


class BrokerUnavailable(BrokerError):
    """The broker could not be reached (after the adapter's reconnect attempts)."""


class UnroutableError(BrokerError):
    """A publish could not be routed to any queue; nothing was sent."""


class PartialPublish(BrokerError):
    """A batch was not fully confirmed. ``ids[i]`` is item ``i``'s message id if the
    broker confirmed it, else None; the cause is the first failure."""

    def __init__(self, message: str, ids: list[str | None]) -> None:
        super().__init__(message)
        self.ids = ids

    @property
    def confirmed(self) -> int:
        """How many items of the batch the broker confirmed."""
        return sum(i is not None for i in self.ids)


class MessageTooLarge(MalformedMessage):
    """A delivery is larger than the adapter's ``max_message_bytes``: dead-lettered
    with this reason (size and bound), never handed to the handler."""


# -- idempotency ----------------------------------------------------------------------


class MissingIdempotencyKey(MalformedMessage):
    """The message has no idempotency key (no key and no id, or the key function gave
    None or ""). A Reject: dead-lettered with a reason that says how to set one, never
    guessed and never stored."""


class ResultNotSerialisable(MsgPatternsError, TypeError):
    """A handler's result cannot be stored as JSON (its type, a NaN, a cycle, too deep).

    Never raised to the caller whose handler produced it - that effect has happened, so
    the key is marked DONE without a result and this error is logged; its text is kept
    as the reason a duplicate's :class:`ResultNotStored` gives.
    """


class ResultNotStored(Reject):
    """A duplicate asked for the stored result of a DONE key that has none.

    The effect was applied once and is not applied again. The reason says why there is
    no result: it was too large, not JSON-serialisable, or the key was completed
    without ``store_result``. A :class:`Reject`: under a ``Consumer`` the duplicate is
    dead-lettered with this reason (pass ``on_duplicate`` to handle it otherwise).
    """


class ResultIntegrityError(ResultNotStored):
    """A duplicate's stored result failed its integrity check (the checker has a
    ``result_key``): it was forged, altered, written without the key or for another
    key. The value is never returned. The effect was applied once and is not applied
    again; as a :class:`ResultNotStored` (a ``Reject``) the duplicate is dead-lettered
    with this reason under a ``Consumer``.
    """


class TransactionAborted(MsgPatternsError):
    """The database aborted the handler's transaction before commit: nothing of it (nor
    the dedup row) was committed. An ordinary failure: the message is retried per the
    retry policy, never acked."""


# -- ordering ---------------------------------------------------------------------------


class InvalidVersion(MalformedMessage):
    """A message's version field is unusable (for example ``new`` is not after
    ``expected``)."""


class MissingVersion(InvalidVersion):
    """A message has no version (or timestamp) field, so it cannot be ordered."""


class UnroutedMessage(MalformedMessage):
    """A message in an ordered topic's partition carries no route version: it was not
    published with ``OrderedTopic.publish``, so nothing says its partition is its
    key's, and its order cannot be kept. It is dead-lettered, never handled."""


class KeyStopped(Reject):
    """An earlier message of this key was dead-lettered and the ordered topic's consumer
    runs with ``on_dead_letter="stop"``: the later ones are dead-lettered too."""


class VersionConflict(Reject):
    """The stored row can never accept this transition: it moved past ``expected``
    along another path (a writer outside the message flow changed the version)."""


class RouteError(ConfigurationError):
    """A route change that breaks the ordered-topic rules (a partition that is not
    open, ranges that are not adjacent, a split point outside the range, a stored
    route that does not parse)."""


class RouteConflict(RouteError):
    """Another route change of the topic is in progress or won the race: one change at
    a time, versions contiguous. Read the routes again and decide anew."""


# -- batching and testing -----------------------------------------------------------------


class InvalidChannel(ConfigurationError):
    """A ``MultipleQueueFlusher``'s ``route(item)`` did not return a channel index in
    ``range(channels)`` (``msgpatterns.batching.RouteError`` is this class)."""


class ScheduleFailure(AssertionError):
    """The invariant (or the handler, unexpectedly) failed on a schedule explored by
    ``msgpatterns.testing.explore_schedules``; the message holds the minimal schedule
    as a story."""


#: The classes that moved here from the modules that raise them keep those modules as
#: their ``__module__`` (each still exports it): a dead letter's ``error_type``
#: (``module.QualName``, also a wire header) and a pickled error read the same as they
#: did before the move, for consumers and stores of every version.
_FORMER_HOMES: dict[type[BaseException], str] = {
    PartialPublish: "msgpatterns.brokers._batch",
    MessageTooLarge: "msgpatterns.limits",
    CheckerClosed: "msgpatterns.idempotency.base",
    MissingIdempotencyKey: "msgpatterns.idempotency.decorator",
    ResultNotSerialisable: "msgpatterns.idempotency.results",
    ResultNotStored: "msgpatterns.idempotency.results",
    ResultIntegrityError: "msgpatterns.idempotency.results",
    TransactionAborted: "msgpatterns.idempotency.guard",
    InvalidVersion: "msgpatterns.ordering.errors",
    MissingVersion: "msgpatterns.ordering.errors",
    UnroutedMessage: "msgpatterns.ordering.errors",
    KeyStopped: "msgpatterns.ordering.errors",
    VersionConflict: "msgpatterns.ordering.errors",
    RouteError: "msgpatterns.ordering.errors",
    RouteConflict: "msgpatterns.ordering.errors",
    ScheduleFailure: "msgpatterns.testing.explore",
}
for _moved, _home in _FORMER_HOMES.items():
    _moved.__module__ = _home


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra to install."""

    def __init__(self, extra: str, package: str) -> None:
        super().__init__(
            f"{package} is required for this feature: pip install 'msgpatterns[{extra}]'"
        )
        self.extra = extra
        self.package = package
