"""Retry schedules (:class:`Backoff`) and the :class:`RetryPolicy` that decides a delivery's fate.

A :class:`Backoff` is a small strategy object in the tenacity style: it *is* a tenacity
wait strategy (``tenacity.Retrying(wait=Backoff.exponential())`` works) and it answers
``delay(attempt)`` for message redelivery. :meth:`RetryPolicy.decide` is the single
place that turns "this delivery ended with that error" into an action; the consumer
runtime, the batching helpers and the broker adapters all go through it.

A Backoff is the one retry vocabulary of the library: :class:`RetryPolicy` (redelivery),
:class:`~msgpatterns.idempotency.StorePolicy` (``backoff=``: retries of an unreachable
store), the broker adapters' reconnects and
:func:`~msgpatterns.ordering.optimistic_update` (``backoff=``) all take one.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import tenacity
from tenacity.wait import wait_base

from msgpatterns import headers as h
from msgpatterns.errors import (
    MAX_DURATION,
    ConfigurationError,
    NeedRetry,
    Reject,
    describe,
    seconds,
)

if TYPE_CHECKING:
    from msgpatterns.message import Message

__all__ = ["Action", "Backoff", "RetryPolicy", "Verdict"]

_SHAPE = tenacity.Retrying()


def _state(attempt: int) -> tenacity.RetryCallState:
    state = tenacity.RetryCallState(_SHAPE, None, (), {})
    state.attempt_number = attempt
    return state


class Backoff(wait_base):
    """A delay schedule: ``delay(attempt)`` seconds before redelivery after failed delivery
    number ``attempt`` (1-based). Also usable as a tenacity ``wait=`` strategy.

    Composition stays a schedule: ``a + b`` (with another Backoff, any tenacity wait or
    a number of seconds) adds the delays, ``a.cap(s)`` and ``a.floor(s)`` bound them, and
    :meth:`of` turns any tenacity wait into a Backoff. Delays are always finite and in
    ``[0, MAX_DURATION]``.
    """

    def delay(self, attempt: int) -> float:
        raise NotImplementedError

    def as_tenacity(self) -> Backoff:
        """This schedule as a tenacity ``wait=`` strategy: the Backoff itself, which
        already is one (``tenacity.Retrying(wait=backoff)`` works as well)."""
        return self

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        return self.delay(retry_state.attempt_number)

    def __add__(self, other: Any) -> _Sum:
        return _Sum((self, Backoff.of(other)))

    def __radd__(self, other: Any) -> Backoff:
        if isinstance(other, int) and other == 0:  # sum([...]) starts at 0
            return self
        return _Sum((Backoff.of(other), self))

    def cap(self, most: float | timedelta) -> Backoff:
        """This schedule with every delay at most ``most`` seconds."""
        return _Bounded(self, 0.0, seconds(most) or 0.0)

    def floor(self, least: float | timedelta) -> Backoff:
        """This schedule with every delay at least ``least`` seconds."""
        return _Bounded(self, seconds(least) or 0.0, MAX_DURATION)

    @staticmethod
    def of(wait: Any) -> Backoff:
        """``wait`` as a Backoff: a Backoff as-is, a tenacity wait strategy (any
        ``wait_base`` or callable taking a ``RetryCallState``) by asking it for each
        attempt, a number or timedelta as a fixed delay."""
        if isinstance(wait, Backoff):
            return wait
        if isinstance(wait, int | float | timedelta) and not isinstance(wait, bool):
            return Backoff.fixed(wait)
        if isinstance(wait, wait_base) or callable(wait):
            return _Tenacity(wait)
        raise ConfigurationError(
            f"a retry schedule must be a Backoff, a tenacity wait or seconds, got {wait!r}"
        )

    @staticmethod
    def exponential(
        initial: float | timedelta = 1.0,
        factor: float = 2.0,
        max: float | timedelta = 7200.0,
        jitter: bool = True,
    ) -> Backoff:
        """``initial * factor**(attempt-1)`` capped at ``max``; with ``jitter`` (the
        default) a uniformly random delay between 0 and that value ("full jitter"), so
        consumers that failed together do not retry together."""
        return _Exponential(seconds(initial) or 0.0, factor, seconds(max) or 0.0, jitter)

    @staticmethod
    def levels(delays: Iterable[float | timedelta]) -> Backoff:
        """A step schedule: attempt ``n`` waits ``delays[n-1]``; past the end, the last."""
        return _Levels(tuple(seconds(d) or 0.0 for d in delays))

    @staticmethod
    def rocketmq() -> Backoff:
        """RocketMQ's 16-step schedule: 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h."""
        return _Levels(ROCKETMQ_LEVELS)

    @staticmethod
    def fixed(delay: float | timedelta) -> Backoff:
        """The same delay for every attempt."""
        return _Levels((seconds(delay) or 0.0,))


ROCKETMQ_LEVELS: tuple[float, ...] = (
    10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600, 7200,
)


class _Exponential(Backoff):
    def __init__(self, initial: float, factor: float, cap: float, jitter: bool) -> None:
        if initial < 0 or factor < 1 or cap < 0:
            raise ConfigurationError(
                "exponential backoff needs initial >= 0, factor >= 1, max >= 0")
        self.initial, self.factor, self.max, self.jitter = initial, factor, cap, jitter
        strategy = tenacity.wait_random_exponential if jitter else tenacity.wait_exponential
        self._wait = strategy(multiplier=initial, exp_base=factor, max=cap)

    def delay(self, attempt: int) -> float:
        return float(self._wait(_state(max(1, attempt))))

    def __repr__(self) -> str:
        return (
            f"Backoff.exponential(initial={self.initial}, factor={self.factor}, "
            f"max={self.max}, jitter={self.jitter})"
        )


class _Levels(Backoff):
    def __init__(self, delays: Sequence[float]) -> None:
        if not delays:
            raise ConfigurationError("Backoff.levels needs at least one delay")
        self.delays = tuple(delays)

    def delay(self, attempt: int) -> float:
        return self.delays[min(max(attempt, 1), len(self.delays)) - 1]

    def __repr__(self) -> str:
        return f"Backoff.levels({list(self.delays)})"


def _bounded_delay(value: Any) -> float:
    """A delay from a composed or foreign strategy, made a valid duration."""
    delay = float(value)
    if math.isnan(delay):
        raise ConfigurationError(f"a retry schedule returned NaN ({value!r})")
    return min(max(delay, 0.0), MAX_DURATION)


class _Sum(Backoff, tenacity.wait_combine):
    """The sum of several schedules; still a tenacity ``wait_combine`` for tenacity."""

    def __init__(self, parts: tuple[Backoff, ...]) -> None:
        flat: list[Backoff] = []
        for part in parts:
            flat.extend(part.parts if isinstance(part, _Sum) else (part,))
        self.parts: tuple[Backoff, ...] = tuple(flat)
        self.wait_funcs = self.parts

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        return self.delay(retry_state.attempt_number)

    def delay(self, attempt: int) -> float:
        return _bounded_delay(sum(part.delay(attempt) for part in self.parts))

    def __repr__(self) -> str:
        return " + ".join(map(repr, self.parts))


class _Bounded(Backoff):
    def __init__(self, inner: Backoff, least: float, most: float) -> None:
        if least > most:
            raise ConfigurationError(f"backoff floor {least:g}s is above its cap {most:g}s")
        self.inner, self.least, self.most = inner, least, most

    def delay(self, attempt: int) -> float:
        return min(max(self.inner.delay(attempt), self.least), self.most)

    def __repr__(self) -> str:
        return f"({self.inner!r}).floor({self.least:g}).cap({self.most:g})"


class _Tenacity(Backoff):
    """A tenacity wait strategy asked for the delay of each attempt."""

    def __init__(self, wait: Any) -> None:
        self.wait = wait

    def delay(self, attempt: int) -> float:
        return _bounded_delay(self.wait(_state(max(1, attempt))))

    def __repr__(self) -> str:
        return f"Backoff.of({self.wait!r})"


class Action(enum.Enum):
    ACK = "ack"
    RETRY_LOCALLY = "retry-locally"
    REDELIVER = "redeliver"
    DEAD_LETTER = "dead-letter"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do with a settled delivery."""

    action: Action
    delay: float = 0.0
    reason: str = ""


_ACK = Verdict(Action.ACK)


@dataclass(frozen=True)
class RetryPolicy:
    """How failed deliveries are retried and when they become dead letters.

    * ``NeedRetry()`` without a delay is retried in-process up to ``local_retries``
      times (waiting ``local_backoff``), then redelivered after ``backoff``.
    * ``NeedRetry(delay)`` is redelivered after ``delay``.
    * ``Reject`` and the ``fatal`` exception types go straight to the dead-letter store.
    * Any other exception is redelivered after ``backoff.delay(attempt)``.
    * Delivery number ``max_attempts`` that fails becomes a dead letter.
    * ``max_delay`` (seconds or timedelta; None: no bound of the policy's own) caps
      every redelivery delay, ``NeedRetry(delay)`` included.

    The attempt number comes from the message (durable), never from this object.

    The policy also bounds what a consumer trusts of the library's headers on the wire
    (:meth:`wire_bounds`; anyone who can publish can set them):

    * an ``x-msgpatterns-attempt`` above ``2 * max_attempts`` is not this policy's
      count (the runtime writes at most ``max_attempts``; the margin covers a message
      handed back with broker redeliveries counted in, or re-sent while the dead-letter
      queue failed): it is ignored and the attempts restart at 1, plus the broker's own
      delivery count (Redis XPENDING, NATS ``num_delivered``, RabbitMQ
      ``x-delivery-count``), which is never bounded. So a forged count cannot skip the
      retries this policy grants; a count of at most ``2 * max_attempts`` cannot be
      told from a real one and is taken as it is.
    * an ``x-msgpatterns-retry-due-at`` further out than ``max_delay`` (7 days when
      None) plus :data:`~msgpatterns.headers.CLOCK_SKEW` (60 s) is taken as due now:
      no header hides a message longer than this policy's longest delay.
    """

    max_attempts: int = 16
    backoff: Backoff = field(default_factory=Backoff.exponential)
    local_retries: int = 3
    fatal: tuple[type[BaseException], ...] = ()
    local_backoff: Backoff = field(
        default_factory=lambda: Backoff.exponential(initial=0.01, factor=2.0, max=1.0)
    )
    max_delay: float | timedelta | None = None

    def __post_init__(self) -> None:
        for name in ("max_attempts", "local_retries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigurationError(f"RetryPolicy {name} must be an int, got {value!r}")
        if self.max_attempts < 1:
            raise ConfigurationError("RetryPolicy max_attempts must be at least 1")
        if self.local_retries < 0:
            raise ConfigurationError("RetryPolicy local_retries cannot be negative")
        # Any tenacity wait (``wait_fixed(1)``, ``Backoff.exponential() + wait_fixed(5)``)
        # becomes a Backoff here, so ``decide`` always has a schedule to ask.
        object.__setattr__(self, "backoff", Backoff.of(self.backoff))
        object.__setattr__(self, "local_backoff", Backoff.of(self.local_backoff))
        fatal = self.fatal
        if isinstance(fatal, type):
            fatal = (fatal,)
        if not isinstance(fatal, tuple) or not all(
            isinstance(t, type) and issubclass(t, BaseException) for t in fatal
        ):
            raise ConfigurationError(
                f"RetryPolicy fatal must be a tuple of exception types, got {self.fatal!r}"
            )
        object.__setattr__(self, "fatal", fatal)
        object.__setattr__(self, "max_delay", seconds(self.max_delay))

    @property
    def longest_delay(self) -> float:
        """The longest redelivery delay this policy writes on the wire, in seconds:
        ``max_delay``, or the library's wire limit (7 days) when it is None."""
        limit = seconds(self.max_delay)
        return h.MAX_RETRY_DELAY if limit is None else limit

    def wire_bounds(self) -> h.WireBounds:
        """What a consumer with this policy trusts of the library's headers on an
        incoming message (see the class docstring): attempts up to ``2 *
        max_attempts`` (at most the library's limit), due times up to
        :attr:`longest_delay` (plus clock skew) ahead."""
        return h.WireBounds(max_attempt=min(2 * self.max_attempts, h.MAX_ATTEMPT),
                            max_delay=min(self.longest_delay, h.MAX_RETRY_DELAY))

    def decide(self, message: Message, error: BaseException | None) -> Verdict:
        """The action for ``message`` whose current attempt ended with ``error``."""
        if error is None:
            return _ACK
        if isinstance(error, Reject):
            return Verdict(Action.DEAD_LETTER, reason=f"rejected: {describe(error)}")
        if self.fatal and isinstance(error, self.fatal):
            return Verdict(
                Action.DEAD_LETTER, reason=f"fatal {type(error).__name__}: {describe(error)}"
            )
        retry = error if isinstance(error, NeedRetry) else None
        if retry is not None and retry.delay is None and message.local_retries < self.local_retries:
            return Verdict(
                Action.RETRY_LOCALLY, self.local_backoff.delay(message.local_retries + 1)
            )
        if message.attempt >= self.max_attempts:
            return Verdict(
                Action.DEAD_LETTER,
                reason=f"gave up after {message.attempt} attempts: "
                f"{type(error).__name__}: {describe(error)}",
            )
        delay = retry.delay if retry is not None and retry.delay is not None else (
            self.backoff.delay(message.attempt))
        if self.max_delay is not None:
            delay = min(delay, self.longest_delay)
        return Verdict(Action.REDELIVER, delay)
