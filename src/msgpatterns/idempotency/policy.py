"""How a checker treats an unreachable store: retry transient errors, then give up.

The first call runs bare (no retry machinery on the fast path); after a transient
error the call is retried by tenacity with exponential backoff, and when the store
stays unreachable :class:`~msgpatterns.errors.StoreUnavailable` is raised. The
``@idempotent`` decorator turns that into ``NeedRetry(policy.unavailable_delay)``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import tenacity

from msgpatterns.errors import StoreUnavailable

__all__ = ["StorePolicy", "call_with_retries"]

log = logging.getLogger("msgpatterns.idempotency")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StorePolicy:
    """Retries against a store that fails transiently (connection lost, timeout,
    lock wait, failover).

    Attributes:
        attempts: calls in total before giving up (1: no retry).
        wait: seconds before the first retry; doubles on each retry.
        max_wait: longest wait between two retries.
        unavailable_delay: the ``NeedRetry`` delay, in seconds, of a message whose
            store stayed unreachable.
    """

    attempts: int = 3
    wait: float = 0.05
    max_wait: float = 1.0
    unavailable_delay: float = 10.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be at least 1")
        if self.wait < 0 or self.max_wait < 0 or self.unavailable_delay < 0:
            raise ValueError("waits and delays cannot be negative")


def call_with_retries(
    fn: Callable[[], T],
    policy: StorePolicy,
    transient: tuple[type[BaseException], ...],
    *,
    what: str,
    on_error: Callable[[BaseException], None] | None = None,
) -> T:
    """``fn()``, retried on ``transient`` errors per ``policy``.

    Raises :class:`StoreUnavailable` (chained to the last error) when every attempt
    failed; any other error propagates at once.
    """
    try:
        return fn()
    except transient as exc:
        first: BaseException | None = exc
        if on_error is not None:
            on_error(exc)
    if policy.attempts == 1:
        raise StoreUnavailable(f"{what}: {first!r}") from first

    def attempt() -> T:
        nonlocal first
        if first is not None:  # replay the bare call's failure so tenacity waits first
            error, first = first, None
            raise error
        try:
            return fn()
        except transient as exc:
            if on_error is not None:
                on_error(exc)
            raise

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(policy.attempts),
        wait=tenacity.wait_exponential(multiplier=policy.wait, min=policy.wait,
                                       max=policy.max_wait),
        retry=tenacity.retry_if_exception_type(transient),
        before_sleep=lambda state: log.debug(
            "%s failed (attempt %d), retrying: %r", what, state.attempt_number,
            state.outcome.exception() if state.outcome else None,
        ),
        reraise=True,
    )
    try:
        return retrying(attempt)
    except transient as exc:
        raise StoreUnavailable(f"{what} failed {policy.attempts} times: {exc!r}") from exc
