"""Read-merge-write with a compare-and-set and a few in-process retries.

The seed pattern: load the current state, merge the message into it, save with a
compare-and-set (``UPDATE ... WHERE version = :read_version``). Losing the race is
normal under contention: try again a few times, then hand the message back for a
delayed redelivery (:class:`~msgpatterns.errors.NeedRetry` with ``retry_later``) rather
than spinning.

:func:`async_optimistic_update` is the same for coroutines (an ``AsyncVersionGuard``'s
``compare_and_set``, say): the same options, checks, retries and NeedRetry - one set of
tenacity options drives a ``Retrying`` or an ``AsyncRetrying`` - with ``load`` and
``save`` awaited and the pauses taken with ``asyncio.sleep``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, ParamSpec, TypeVar, overload

import tenacity
from tenacity.wait import WaitBaseT, wait_base

from msgpatterns._callables import require_async_callable, require_sync_callable
from msgpatterns.errors import ConfigurationError, NeedRetry, seconds
from msgpatterns.retry import Backoff

__all__ = ["DEFAULT_BACKOFF", "DEFAULT_WAIT", "async_optimistic_update", "optimistic_update"]

P = ParamSpec("P")
C = TypeVar("C")
M = TypeVar("M")

#: Pause between attempts: random, up to 5 ms, so contenders spread out.
DEFAULT_BACKOFF: Backoff = Backoff.of(tenacity.wait_random(0, 0.005))
#: The former name of :data:`DEFAULT_BACKOFF`.
DEFAULT_WAIT: WaitBaseT = DEFAULT_BACKOFF


def _schedule(backoff: object, wait: object) -> Backoff:
    """The pause between rounds as a :class:`~msgpatterns.Backoff`: ``backoff`` (or
    ``wait``, its deprecated alias) if it is one, a tenacity wait or a sync
    ``wait(retry_state) -> seconds``; :data:`DEFAULT_BACKOFF` when neither is given."""
    if backoff is not None and wait is not None:
        raise ConfigurationError("pass backoff or its former name wait, not both")
    name, given = ("wait", wait) if wait is not None else ("backoff", backoff)
    if given is None:
        return DEFAULT_BACKOFF
    if not isinstance(given, wait_base):
        if not callable(given):
            raise ConfigurationError(
                f"{name} must be a msgpatterns Backoff or a tenacity wait (e.g. "
                f"tenacity.wait_random(0, 0.01)), got {given!r}"
            )
        require_sync_callable(given, what=name, where="optimistic_update")
    return Backoff.of(given)


def _retrying(attempts: int, retry_later: float | timedelta, backoff: Backoff,
              lost: Callable[[Any], bool]) -> dict[str, Any]:
    """The tenacity options (for ``Retrying`` or ``AsyncRetrying``): retry while
    ``lost(result)``; after ``attempts`` lost rounds raise NeedRetry.

    Every argument is checked here, when the update is set up (or decorated), never
    after the first lost round.
    """
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ConfigurationError(f"attempts must be an int of at least 1, got {attempts!r}")
    try:
        delay = seconds(retry_later)
    except ConfigurationError as exc:
        raise ConfigurationError(f"retry_later: {exc}") from None

    def give_up(state: tenacity.RetryCallState) -> Any:
        raise NeedRetry(
            delay=delay,
            reason=f"optimistic update lost the compare-and-set {state.attempt_number} "
            "times in a row",
        )

    return {"stop": tenacity.stop_after_attempt(attempts),
            "retry": tenacity.retry_if_result(lost), "wait": backoff,
            "retry_error_callback": give_up}


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
    backoff: Backoff | WaitBaseT | None = None,
    wait: WaitBaseT | None = None,
) -> M: ...


@overload
def optimistic_update(load: Callable[P, bool], /) -> Callable[P, bool]: ...


@overload
def optimistic_update(
    *,
    attempts: int = 3,
    retry_later: float | timedelta = 10.0,
    backoff: Backoff | WaitBaseT | None = None,
    wait: WaitBaseT | None = None,
) -> Callable[[Callable[P, bool]], Callable[P, bool]]: ...


def optimistic_update(
    load: Callable[..., Any] | None = None,
    merge: Callable[[Any], Any] | None = None,
    save: Callable[[Any, Any], bool] | None = None,
    attempts: int = 3,
    retry_later: float | timedelta = 10.0,
    *,
    backoff: Backoff | WaitBaseT | None = None,
    wait: WaitBaseT | None = None,
) -> Any:
    """Read-merge-write that never loses a concurrent update.

    As a call: ``optimistic_update(load, merge, save)`` runs ``current = load()``,
    ``merged = merge(current)``, ``save(current, merged)`` and returns ``merged`` once
    ``save`` - a compare-and-set - returns True. When it returns False (another writer
    got there first) the whole round repeats with fresh data, up to ``attempts`` rounds
    in all, pausing ``backoff`` (a :class:`~msgpatterns.Backoff`, or any tenacity wait
    strategy; ``wait`` is its former name, still accepted) between them. After
    ``attempts`` lost rounds it raises ``NeedRetry(delay=retry_later)``: the message
    comes back later instead of spinning.

    As a decorator (``@optimistic_update`` or ``@optimistic_update(attempts=5)``): the
    function makes one round itself and returns whether its compare-and-set won; it is
    retried the same way, and the decorated call returns its (truthy) result.

    Exceptions from ``load``, ``merge`` or ``save`` propagate at once; only a lost
    compare-and-set is retried. Every round must read fresh data: on MySQL/MariaDB
    (REPEATABLE READ) run each round's load in a new transaction.

    Misuse is refused before anything runs: an ``async def`` (or a partial or object
    wrapping one) as ``load``, ``merge``, ``save`` or the decorated function raises
    ``TypeError`` - its coroutine object would look like a won compare-and-set - and
    ``attempts``, ``retry_later`` or ``backoff`` of the wrong kind raise
    :class:`~msgpatterns.errors.ConfigurationError`.
    """
    schedule = _schedule(backoff, wait)
    form = _form(load, merge, save, attempts, retry_later, schedule, tenacity.Retrying,
                 require_sync_callable, "")
    if form is not None:
        return form
    assert load is not None and merge is not None and save is not None
    retrying = tenacity.Retrying(**_retrying(attempts, retry_later, schedule, _first_lost))

    def attempt() -> tuple[bool, Any]:
        current = load()
        merged = merge(current)
        return bool(save(current, merged)), merged

    return retrying(attempt)[1]


def _form(load: Callable[..., Any] | None, merge: Callable[..., Any] | None,
          save: Callable[..., Any] | None, attempts: int, retry_later: float | timedelta,
          schedule: Backoff, kind: Callable[..., Any], require: Callable[..., None],
          prefix: str) -> Any:
    """The decorator forms (``@f`` and ``@f(...)``) of ``{prefix}optimistic_update``
    with ``kind`` (``Retrying`` or ``AsyncRetrying``); None for the call form, whose
    callables are checked here by ``require``."""
    name = f"{prefix}optimistic_update"
    if load is not None and merge is None and save is None:
        return _decorate(load, kind(**_retrying(attempts, retry_later, schedule, _falsy)),
                         require, name)
    if load is None and merge is None and save is None:
        _retrying(attempts, retry_later, schedule, _falsy)  # refuse bad options now

        def decorate(fn: Callable[P, Any]) -> Callable[P, Any]:
            return _decorate(fn, kind(**_retrying(attempts, retry_later, schedule, _falsy)),
                             require, name)

        return decorate
    if load is None or merge is None or save is None:
        raise ConfigurationError(f"{name} needs all of load, merge and save (or none)")
    for what, fn in (("load", load), ("save", save)):
        _require(require, fn, what, name)
    require_sync_callable(merge, what="merge", where=name)
    return None


def _require(require: Callable[..., None], fn: Any, what: str, where: str) -> None:
    if require is require_async_callable:
        require(fn, what=what, where=where, alternative="optimistic_update")
    else:
        require(fn, what=what, where=where)


def _decorate(fn: Callable[P, Any], retrying: Any, require: Callable[..., None],
              where: str) -> Callable[P, Any]:
    """``fn`` retried by ``retrying`` while it returns a falsy result."""
    _require(require, fn, "function", f"@{where}")
    wrapped: Callable[P, Any] = retrying.wraps(fn)
    return wrapped


@overload
def async_optimistic_update(
    load: Callable[[], Awaitable[C]],
    merge: Callable[[C], M],
    save: Callable[[C, M], Awaitable[bool]],
    attempts: int = 3,
    retry_later: float | timedelta = 10.0,
    *,
    backoff: Backoff | WaitBaseT | None = None,
) -> Awaitable[M]: ...


@overload
def async_optimistic_update(
    load: Callable[P, Awaitable[bool]], /,
) -> Callable[P, Awaitable[bool]]: ...


@overload
def async_optimistic_update(
    *,
    attempts: int = 3,
    retry_later: float | timedelta = 10.0,
    backoff: Backoff | WaitBaseT | None = None,
) -> Callable[[Callable[P, Awaitable[bool]]], Callable[P, Awaitable[bool]]]: ...


def async_optimistic_update(
    load: Callable[..., Any] | None = None,
    merge: Callable[[Any], Any] | None = None,
    save: Callable[[Any, Any], Any] | None = None,
    attempts: int = 3,
    retry_later: float | timedelta = 10.0,
    *,
    backoff: Backoff | WaitBaseT | None = None,
) -> Any:
    """:func:`optimistic_update` for coroutines: the same rounds, retries and
    ``NeedRetry(delay=retry_later)`` after ``attempts`` lost rounds.

    As a call: ``await async_optimistic_update(load, merge, save)`` with ``load`` and
    ``save`` ``async def`` and ``merge`` a plain function (it computes, it does no
    I/O). As a decorator (``@async_optimistic_update`` or
    ``@async_optimistic_update(attempts=5)``) on an ``async def`` that makes one round
    and returns whether its compare-and-set won. Pauses between rounds are
    ``asyncio.sleep``: the event loop is never blocked.

    Misuse is refused before anything runs: a sync ``load``, ``save`` or decorated
    function raises ``TypeError`` naming :func:`optimistic_update`, options of the
    wrong kind :class:`~msgpatterns.errors.ConfigurationError`.
    """
    schedule = _schedule(backoff, None)
    form = _form(load, merge, save, attempts, retry_later, schedule, tenacity.AsyncRetrying,
                 require_async_callable, "async_")
    if form is not None:
        return form
    assert load is not None and merge is not None and save is not None
    retrying = tenacity.AsyncRetrying(**_retrying(attempts, retry_later, schedule,
                                                  _first_lost))

    async def attempt() -> tuple[bool, Any]:
        current = await load()
        merged = merge(current)
        return bool(await save(current, merged)), merged

    async def run() -> Any:
        return (await retrying(attempt))[1]

    return run()
