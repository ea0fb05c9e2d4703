"""How a checker treats an unreachable store: retry transient errors, then give up.

The first call runs bare (no retry machinery on the fast path); after a transient
error the call is retried by tenacity, waiting per the policy's
:class:`~msgpatterns.Backoff`, and when the store stays unreachable
:class:`~msgpatterns.errors.StoreUnavailable` is raised. The ``@idempotent``
decorator turns that into ``NeedRetry(policy.unavailable_delay)``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

from msgpatterns.errors import ConfigurationError, StoreUnavailable
from msgpatterns.retry import Backoff

__all__ = ["StorePolicy", "acall_with_retries", "aretry_after", "call_with_retries",
           "retry_after"]

log = logging.getLogger("msgpatterns.idempotency")

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StorePolicy:
    """Retries against a store that fails transiently (connection lost, timeout,
    lock wait, failover).

    Attributes:
        attempts: calls in total before giving up (1: no retry).
        wait: deprecated shorthand, kept working: with ``max_wait`` it stands for
            ``backoff=Backoff.exponential(initial=wait, max=max_wait, jitter=False)``
            (``wait`` seconds before the first retry, doubling on each retry).
        max_wait: deprecated shorthand (see ``wait``): longest wait between retries.
        unavailable_delay: the ``NeedRetry`` delay, in seconds, of a message whose
            store stayed unreachable.
        backoff: the wait before each retry, a :class:`~msgpatterns.Backoff` (or
            anything :meth:`Backoff.of <msgpatterns.Backoff.of>` takes: a tenacity
            wait, seconds). When given, ``wait`` and ``max_wait`` are not used.
    """

    attempts: int = 3
    wait: float = 0.05
    max_wait: float = 1.0
    unavailable_delay: float = 10.0
    backoff: Backoff | None = None

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) \
                or self.attempts < 1:
            raise ConfigurationError(
                f"StorePolicy attempts must be an int of at least 1, got {self.attempts!r}")
        if self.wait < 0 or self.max_wait < 0 or self.unavailable_delay < 0:
            raise ConfigurationError("StorePolicy waits and delays cannot be negative")
        if self.backoff is not None:
            object.__setattr__(self, "backoff", Backoff.of(self.backoff))

    @property
    def schedule(self) -> Backoff:
        """The wait before retry ``n``: ``backoff``, or the schedule ``wait`` and
        ``max_wait`` stand for."""
        if self.backoff is not None:
            return self.backoff
        return _shorthand(self.wait, self.max_wait)

    def call(
        self,
        fn: Callable[[], T],
        transient: tuple[type[BaseException], ...],
        *,
        what: str,
    ) -> T:
        """``fn()``, retried on ``transient`` errors per this policy; raises
        :class:`~msgpatterns.errors.StoreUnavailable` (chained to the last error) when
        every attempt failed. Any other error propagates at once."""
        return call_with_retries(fn, self, transient, what=what)


@functools.lru_cache(maxsize=64)
def _shorthand(wait: float, max_wait: float) -> Backoff:
    """``wait`` doubling per retry, at most ``max_wait`` (never below ``wait``)."""
    return Backoff.exponential(initial=wait, factor=2.0, max=max(wait, max_wait),
                               jitter=False)


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
        first: BaseException = exc
    return retry_after(first, fn, policy, transient, what=what, on_error=on_error)


def retry_after(
    first: BaseException,
    fn: Callable[[], T],
    policy: StorePolicy,
    transient: tuple[type[BaseException], ...],
    *,
    what: str,
    on_error: Callable[[BaseException], None] | None = None,
) -> T:
    """What :func:`call_with_retries` does once the first ``fn()`` failed with
    ``first`` (a ``transient`` error): for a caller that made the first attempt
    itself."""
    retries = _Retries(policy, transient, what, on_error, first)
    try:
        result: T = retries.retrying(tenacity.Retrying)(retries.attempt(fn))
        return result
    except transient as exc:
        raise retries.gave_up(exc) from exc


async def acall_with_retries(
    fn: Callable[[], Awaitable[T]],
    policy: StorePolicy,
    transient: tuple[type[BaseException], ...],
    *,
    what: str,
    on_error: Callable[[BaseException], None] | None = None,
) -> T:
    """:func:`call_with_retries` for an async ``fn``: the same attempts, waits and
    :class:`StoreUnavailable`, waiting with ``asyncio.sleep``."""
    try:
        return await fn()
    except transient as exc:
        first: BaseException = exc
    return await aretry_after(first, fn, policy, transient, what=what, on_error=on_error)


async def aretry_after(
    first: BaseException,
    fn: Callable[[], Awaitable[T]],
    policy: StorePolicy,
    transient: tuple[type[BaseException], ...],
    *,
    what: str,
    on_error: Callable[[BaseException], None] | None = None,
) -> T:
    """:func:`retry_after` for an async ``fn``."""
    retries = _Retries(policy, transient, what, on_error, first)
    try:
        call = retries.attempt(fn)

        async def attempt() -> T:  # tenacity awaits only coroutine functions
            return await call()

        result: T = await retries.retrying(tenacity.AsyncRetrying)(attempt)
        return result
    except transient as exc:
        raise retries.gave_up(exc) from exc


class _Retries:
    """The retries after a bare first call failed with ``first`` (shared by the sync
    and the async form): tenacity waits first, then calls again."""

    def __init__(self, policy: StorePolicy, transient: tuple[type[BaseException], ...],
                 what: str, on_error: Callable[[BaseException], None] | None,
                 first: BaseException) -> None:
        self.policy, self.transient, self.what = policy, transient, what
        self.on_error = on_error
        self.first: BaseException | None = first
        self.replayed = first
        if on_error is not None:
            on_error(first)
        if policy.attempts == 1:
            raise StoreUnavailable(f"{what}: {_describe(first)}") from first

    def attempt(self, fn: Callable[[], T]) -> Callable[[], T]:
        """``fn`` that first replays the bare call's failure (so tenacity waits first)."""
        def attempt() -> T:
            if self.first is not None:
                error, self.first = self.first, None
                raise error
            return fn()

        return attempt

    def _transient(self, error: BaseException) -> bool:
        """Whether ``error`` is retried; counts each one (the replayed first error was
        counted already)."""
        if not isinstance(error, self.transient):
            return False
        if error is not self.replayed and self.on_error is not None:
            self.on_error(error)
        return True

    def retrying(self, kind: Callable[..., Any]) -> Any:
        what = self.what
        return kind(
            stop=tenacity.stop_after_attempt(self.policy.attempts),
            wait=self.policy.schedule,
            retry=tenacity.retry_if_exception(self._transient),
            before_sleep=lambda state: log.debug(
                "%s failed (attempt %d), retrying: %r", what, state.attempt_number,
                state.outcome.exception() if state.outcome else None,
            ),
            reraise=True,
        )

    def gave_up(self, error: BaseException) -> StoreUnavailable:
        return StoreUnavailable(
            f"{self.what} failed {self.policy.attempts} times: {_describe(error)}")


def _describe(error: BaseException | None) -> str:
    """``Type: message`` of a client error (some clients' reprs drop the message)."""
    return f"{type(error).__name__}: {error}"
