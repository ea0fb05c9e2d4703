"""The reconnect policy the broker adapters share (a tenacity ``Retrying``).

Guarantees: only ``errors`` are retried, and never one of ``fatal`` (authentication
and permission failures are configuration mistakes, not transient faults: retrying
them only delays the one clear error the user needs); the wait between attempts is
``backoff`` (a :class:`~msgpatterns.Backoff`, by default :data:`RECONNECT_BACKOFF`: a
jittered exponential backoff capped at 5 s); the last error is re-raised when
the policy gives up (after ``attempts``, after ``within`` seconds, or once ``until`` is
set).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import tenacity

from msgpatterns.retry import Backoff

__all__ = ["RECONNECT_BACKOFF", "reconnect_backoff", "reconnecting"]


def reconnect_backoff(most: float = 5.0) -> Backoff:
    """The adapters' wait between reconnect attempts: 50 ms doubling, full jitter, at
    most ``most`` seconds."""
    return Backoff.exponential(initial=0.05, factor=2.0, max=most)


#: The default wait between reconnect attempts (at most 5 s).
RECONNECT_BACKOFF = reconnect_backoff()


def reconnecting(
    errors: tuple[type[BaseException], ...],
    *,
    logger: logging.Logger,
    what: str,
    attempts: int | None = 8,
    backoff: Backoff | None = None,
    max_wait: float | None = None,
    until: threading.Event | None = None,
    within: float | None = None,
    fatal: tuple[type[BaseException], ...] = (),
) -> tenacity.Retrying:
    """Retry an operation on ``errors`` (but never on ``fatal``), waiting ``backoff``
    between attempts (default :data:`RECONNECT_BACKOFF`). ``max_wait`` is the
    deprecated shorthand for ``backoff=reconnect_backoff(max_wait)``.

    ``attempts=None`` retries until ``until`` is set (a reconnect loop that runs until
    the adapter is closed) or ``within`` seconds have passed; the last error is
    re-raised when giving up.
    """
    stop: tenacity.stop.stop_base
    stop = tenacity.stop_never if attempts is None else tenacity.stop_after_attempt(attempts)
    if until is not None:
        stop = stop | tenacity.stop_when_event_set(until)
    if within is not None:
        stop = stop | tenacity.stop_after_delay(within)
    if backoff is None:
        backoff = RECONNECT_BACKOFF if max_wait is None else reconnect_backoff(max_wait)
    retry: Any = tenacity.retry_if_exception_type(errors)
    if fatal:
        retry = retry & tenacity.retry_if_not_exception_type(fatal)
    return tenacity.Retrying(
        retry=retry,
        wait=backoff,
        stop=stop,
        reraise=True,
        before_sleep=lambda state: logger.warning(
            "%s failed (%r); retrying (attempt %d)",
            what, state.outcome.exception() if state.outcome else None, state.attempt_number,
        ),
    )
