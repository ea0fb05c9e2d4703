"""Read-merge-write with a compare-and-set and a few in-process retries.

The seed pattern: load the current state, merge the message into it, save with a
compare-and-set (``UPDATE ... WHERE version = :read_version``). Losing the race is
normal under contention: try again a few times, then hand the message back for a
delayed redelivery (:class:`~msgpatterns.errors.NeedRetry` with ``retry_later``) rather
than spinning.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar, overload

import tenacity
from tenacity.wait import WaitBaseT

from msgpatterns.errors import NeedRetry, seconds

__all__ = ["DEFAULT_WAIT", "optimistic_update"]

P = ParamSpec("P")
C = TypeVar("C")
M = TypeVar("M")

#: Pause between attempts: random, up to 5 ms, so contenders spread out.
DEFAULT_WAIT: WaitBaseT = tenacity.wait_random(0, 0.005)


def _retrying(attempts: int, retry_later: float | timedelta, wait: WaitBaseT | None,
              lost: Callable[[Any], bool]) -> tenacity.Retrying:
    """Retry while ``lost(result)``; after ``attempts`` lost rounds raise NeedRetry."""
    delay = seconds(retry_later)

    def give_up(state: tenacity.RetryCallState) -> Any:
        raise NeedRetry(
            delay=delay,
            reason=f"optimistic update lost the compare-and-set {state.attempt_number} "
            "times in a row",
        )

    return tenacity.Retrying(
        stop=tenacity.stop_after_attempt(attempts),
        retry=tenacity.retry_if_result(lost),
        wait=DEFAULT_WAIT if wait is None else wait,
        retry_error_callback=give_up,
    )


def _first_lost(outcome: tuple[bool, object]) -> bool:
    return not outcome[0]


def _falsy(result: object) -> bool:
    return not result


@overload
def optimistic_update(
    load: Callable[[], C],
    merge: Callable[[C], M],
    save: Callable[[C, M], bool],
    attempts: int = 3,
    retry_later: float | timedelta = 10.0,
    *,
    wait: WaitBaseT | None = None,
) -> M: ...


@overload
def optimistic_update(load: Callable[P, bool], /) -> Callable[P, bool]: ...


@overload
def optimistic_update(
    *,
    attempts: int = 3,
    retry_later: float | timedelta = 10.0,
    wait: WaitBaseT | None = None,
) -> Callable[[Callable[P, bool]], Callable[P, bool]]: ...


def optimistic_update(
    load: Callable[..., Any] | None = None,
    merge: Callable[[Any], Any] | None = None,
    save: Callable[[Any, Any], bool] | None = None,
    attempts: int = 3,
    retry_later: float | timedelta = 10.0,
    *,
    wait: WaitBaseT | None = None,
) -> Any:
    """Read-merge-write that never loses a concurrent update.

    As a call: ``optimistic_update(load, merge, save)`` runs ``current = load()``,
    ``merged = merge(current)``, ``save(current, merged)`` and returns ``merged`` once
    ``save`` - a compare-and-set - returns True. When it returns False (another writer
    got there first) the whole round repeats with fresh data, up to ``attempts`` rounds
    in all, pausing ``wait`` (a tenacity wait strategy or a
    :class:`~msgpatterns.Backoff`) between them. After ``attempts`` lost rounds it raises
    ``NeedRetry(delay=retry_later)``: the message comes back later instead of spinning.

    As a decorator (``@optimistic_update`` or ``@optimistic_update(attempts=5)``): the
    function makes one round itself and returns whether its compare-and-set won; it is
    retried the same way, and the decorated call returns its (truthy) result.

    Exceptions from ``load``, ``merge`` or ``save`` propagate at once; only a lost
    compare-and-set is retried. Every round must read fresh data: on MySQL/MariaDB
    (REPEATABLE READ) run each round's load in a new transaction.
    """
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    if load is not None and merge is None and save is None:
        return _retrying(attempts, retry_later, wait, _falsy).wraps(load)
    if load is None and merge is None and save is None:

        def decorate(fn: Callable[P, bool]) -> Callable[P, bool]:
            return _retrying(attempts, retry_later, wait, _falsy).wraps(fn)

        return decorate
    if load is None or merge is None or save is None:
        raise TypeError("optimistic_update needs all of load, merge and save (or none)")

    def attempt() -> tuple[bool, Any]:
        current = load()
        merged = merge(current)
        return bool(save(current, merged)), merged

    return _retrying(attempts, retry_later, wait, _first_lost)(attempt)[1]
