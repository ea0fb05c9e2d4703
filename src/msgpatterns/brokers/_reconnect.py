"""The reconnect policy the broker adapters share (a tenacity ``Retrying``)."""

from __future__ import annotations

import logging
import threading

import tenacity

from msgpatterns.retry import Backoff

__all__ = ["reconnecting"]


def reconnecting(
    errors: tuple[type[BaseException], ...],
    *,
    logger: logging.Logger,
    what: str,
    attempts: int | None = 8,
    max_wait: float = 5.0,
    until: threading.Event | None = None,
) -> tenacity.Retrying:
    """Retry an operation on ``errors`` with jittered exponential backoff.

    ``attempts=None`` retries until ``until`` is set (a reconnect loop that runs until
    the adapter is closed); the last error is re-raised when giving up.
    """
    stop: tenacity.stop.stop_base
    stop = tenacity.stop_never if attempts is None else tenacity.stop_after_attempt(attempts)
    if until is not None:
        stop = stop | tenacity.stop_when_event_set(until)
    return tenacity.Retrying(
        retry=tenacity.retry_if_exception_type(errors),
        wait=Backoff.exponential(initial=0.05, factor=2.0, max=max_wait),
        stop=stop,
        reraise=True,
        before_sleep=lambda state: logger.warning(
            "%s failed (%r); retrying (attempt %d)",
            what, state.outcome.exception() if state.outcome else None, state.attempt_number,
        ),
    )

