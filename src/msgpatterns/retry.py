"""Retry schedules (:class:`Backoff`) and the :class:`RetryPolicy` that decides a delivery's fate.

A :class:`Backoff` is a small strategy object in the tenacity style: it *is* a tenacity
wait strategy (``tenacity.Retrying(wait=Backoff.exponential())`` works) and it answers
``delay(attempt)`` for message redelivery. :meth:`RetryPolicy.decide` is the single
place that turns "this delivery ended with that error" into an action; the consumer
runtime, the batching helpers and the broker adapters all go through it.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING

import tenacity
from tenacity.wait import wait_base

from msgpatterns.errors import NeedRetry, Reject, seconds

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
    number ``attempt`` (1-based). Also usable as a tenacity ``wait=`` strategy."""

    def delay(self, attempt: int) -> float:
        raise NotImplementedError

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        return self.delay(retry_state.attempt_number)

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
            raise ValueError("exponential backoff needs initial >= 0, factor >= 1, max >= 0")
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
            raise ValueError("Backoff.levels needs at least one delay")
        self.delays = tuple(delays)

    def delay(self, attempt: int) -> float:
        return self.delays[min(max(attempt, 1), len(self.delays)) - 1]

    def __repr__(self) -> str:
        return f"Backoff.levels({list(self.delays)})"


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

    The attempt number comes from the message (durable), never from this object.
    """

    max_attempts: int = 16
    backoff: Backoff = field(default_factory=Backoff.exponential)
    local_retries: int = 3
    fatal: tuple[type[BaseException], ...] = ()
    local_backoff: Backoff = field(
        default_factory=lambda: Backoff.exponential(initial=0.01, factor=2.0, max=1.0)
    )

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.local_retries < 0:
            raise ValueError("local_retries cannot be negative")

    def decide(self, message: Message, error: BaseException | None) -> Verdict:
        """The action for ``message`` whose current attempt ended with ``error``."""
        if error is None:
            return _ACK
        if isinstance(error, Reject):
            return Verdict(Action.DEAD_LETTER, reason=f"rejected: {error}")
        if self.fatal and isinstance(error, self.fatal):
            return Verdict(Action.DEAD_LETTER, reason=f"fatal {type(error).__name__}: {error}")
        retry = error if isinstance(error, NeedRetry) else None
        if retry is not None and retry.delay is None and message.local_retries < self.local_retries:
            return Verdict(
                Action.RETRY_LOCALLY, self.local_backoff.delay(message.local_retries + 1)
            )
        if message.attempt >= self.max_attempts:
            return Verdict(
                Action.DEAD_LETTER,
                reason=f"gave up after {message.attempt} attempts: {type(error).__name__}: {error}",
            )
        if retry is not None and retry.delay is not None:
            return Verdict(Action.REDELIVER, retry.delay)
        return Verdict(Action.REDELIVER, self.backoff.delay(message.attempt))
