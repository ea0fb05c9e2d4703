"""The lease rules for one sync guarded call, in direct style: the per-call hot path.

:func:`~msgpatterns.idempotency.guard.lease_steps` states the six rules once, as
steps that a driver performs: the async driver, the batch paths and every other caller
run them. A sync lease checker's single guarded call (``execute``, so every
``@idempotent`` call of a sync handler) runs :func:`lease_call` instead: the same rules
in the same order, asking ``perform`` for the same store operations (:class:`Io`, one
round trip each) and counting, logging and raising the same, written as plain calls -
``yield step`` is ``perform(step)`` here and ``yield Run(None)`` is ``call(None)`` -
without the generator and its driver loop.

An async lease checker's single guarded call (``aexecute``, so every ``@idempotent``
call of an ``async def`` handler) runs :func:`alease_call`, the same again with each
store operation and the handler awaited, instead of ``adrive(lease_steps(...))``.

Each is a fast path with a plain twin: ``tests/reliability/test_differential_lease_call.py`` runs
generated schedules (repeated keys, handlers that fail, store faults, leases that
expire, write-behind, stored results, fingerprints, fail-open) through
``drive(lease_steps(...))`` and through :func:`lease_call` on twin checkers and
requires the same outcomes, errors, store records, counters and round trips;
``test_differential_alease_call.py`` does the same for :func:`alease_call` against
``adrive(lease_steps(...))``. A change to one must be made to the others.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from msgpatterns.errors import StoreUnavailable
from msgpatterns.idempotency.guard import (
    COUNTERS,
    ClaimRequest,
    Executed,
    Io,
    LeaseRules,
    Options,
    classify,
    log_lease_gone,
    log_lost,
    log_not_completed,
    log_not_released,
    new_token,
    queued_claim,
    refuse_unavailable,
    skip_or_raise,
    with_result,
)
from msgpatterns.idempotency.records import Status

__all__ = ["alease_call", "lease_call"]

CLAIMED = Status.CLAIMED

#: ``tuple.__new__``: how the hot paths build their named tuples (``Io``,
#: ``ClaimRequest``, ``Executed``) with every field given, without the Python-level
#: ``__new__`` a named tuple's constructor runs (a frame per tuple, a tenth of the
#: client's work per call).
_new = tuple.__new__

R = TypeVar("R")


def lease_call(rules: LeaseRules, perform: Callable[[Io], Any], store_key: str,
               fingerprint: str | None, options: Options,
               call: Callable[[Any], R]) -> Executed[R]:
    """The six rules for one call on a lease store (:func:`~msgpatterns.idempotency.
    guard.lease_steps`, performed synchronously): ``perform`` does each store operation
    (a round trip, retried and reported, :class:`StoreUnavailable` when the store
    stays unreachable), ``call(None)`` runs the handler."""
    stats = rules.stats
    try:  # rule 1 (guard.claim_one_steps)
        held = rules.pending(store_key) if rules.pending is not None else None
        if held is not None:
            claim = queued_claim(held, fingerprint)
        else:
            fresh = new_token()
            (record,) = perform(_new(Io, ("claim_many", [
                _new(ClaimRequest, (store_key, fresh, fingerprint, None))], True, None)))
            claim = classify(store_key, record, fresh, fingerprint)
        status = claim.status
        stats.add("claimed" if status is CLAIMED else COUNTERS[status])  # no Enum hash
    except StoreUnavailable as exc:  # rule 6
        refusal = refuse_unavailable(stats, store_key, exc, fail_open=options.fail_open,
                                     delay=rules.unavailable_delay)
        if refusal is not None:
            raise refusal from exc
        return Executed(True, call(None), None)
    token = claim.token
    if token is None:  # rules 4 and 5, the fingerprint check
        return skip_or_raise(claim, options.store_result, options.result_key)
    try:
        result = call(None)
    except BaseException:  # rule 3 (guard.release_steps)
        try:
            (released,) = perform(Io("release_many", [
                ClaimRequest(claim.key, token, claim.fingerprint, claim.result)]))
            stats.add("released", int(released))
            if not released:
                log_lease_gone(claim.key)
        except StoreUnavailable as exc:
            log_not_released(claim.key, exc)
        raise
    if options.store_result:
        claim = with_result(claim, result, stats, options.max_result_bytes,
                            options.result_key)
    if rules.pending is not None and perform(Io("queue", claim, retried=False)):
        return _new(Executed, (True, result, claim))  # write-behind
    try:  # rule 2 (guard.complete_steps)
        done = perform(_new(Io, ("complete_many", [
            _new(ClaimRequest, (claim.key, token, claim.fingerprint, claim.result))], True, None)))
        log_lost([claim], done, stats)
    except StoreUnavailable as exc:
        log_not_completed(store_key, exc)
    return _new(Executed, (True, result, claim))


async def alease_call(rules: LeaseRules, perform: Callable[[Io], Awaitable[Any]],
                      store_key: str, fingerprint: str | None, options: Options,
                      call: Callable[[Any], Awaitable[R]]) -> Executed[R]:
    """:func:`lease_call` for an async lease checker (``aexecute``, so every
    ``@idempotent`` call of an ``async def`` handler): the same rules, each store
    operation and the handler awaited - ``adrive(lease_steps(...))`` without the
    generator, its driver loop and a coroutine per step. A cancelled handler releases
    its claim like one that raises. Its plain twin is ``adrive(lease_steps(...))``
    (``tests/reliability/test_differential_alease_call.py``); a change to one must be
    made to the other, and to :func:`lease_call`."""
    stats = rules.stats
    try:  # rule 1 (guard.claim_one_steps)
        held = rules.pending(store_key) if rules.pending is not None else None
        if held is not None:
            claim = queued_claim(held, fingerprint)
        else:
            fresh = new_token()
            (record,) = await perform(_new(Io, ("claim_many", [
                _new(ClaimRequest, (store_key, fresh, fingerprint, None))], True, None)))
            claim = classify(store_key, record, fresh, fingerprint)
        status = claim.status
        stats.add("claimed" if status is CLAIMED else COUNTERS[status])
    except StoreUnavailable as exc:  # rule 6
        refusal = refuse_unavailable(stats, store_key, exc, fail_open=options.fail_open,
                                     delay=rules.unavailable_delay)
        if refusal is not None:
            raise refusal from exc
        return Executed(True, await call(None), None)
    token = claim.token
    if token is None:  # rules 4 and 5, the fingerprint check
        return skip_or_raise(claim, options.store_result, options.result_key)
    try:
        result = await call(None)
    except BaseException:  # rule 3 (guard.release_steps), a cancellation included
        try:
            (released,) = await perform(Io("release_many", [
                ClaimRequest(claim.key, token, claim.fingerprint, claim.result)]))
            stats.add("released", int(released))
            if not released:
                log_lease_gone(claim.key)
        except StoreUnavailable as exc:
            log_not_released(claim.key, exc)
        raise
    if options.store_result:
        claim = with_result(claim, result, stats, options.max_result_bytes,
                            options.result_key)
    if rules.pending is not None and await perform(Io("queue", claim, retried=False)):
        return _new(Executed, (True, result, claim))  # write-behind
    try:  # rule 2 (guard.complete_steps)
        done = await perform(_new(Io, ("complete_many", [
            _new(ClaimRequest, (claim.key, token, claim.fingerprint, claim.result))], True, None)))
        log_lost([claim], done, stats)
    except StoreUnavailable as exc:
        log_not_completed(store_key, exc)
    return _new(Executed, (True, result, claim))
