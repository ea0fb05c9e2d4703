"""The idempotency guard: the six rules, written once for every store and both drivers.

The rules (see :mod:`msgpatterns.idempotency.base`) are *steps*: generators that
yield what they need done - a store operation (:class:`Io`) or the handler's run
(:class:`Run`) - and receive its answer, or its exception, back. They never do I/O.
Two drivers perform the steps: :func:`drive` calls the store and the handler (sync
checkers), :func:`adrive` awaits them (async checkers). So the claim, the skip, the
in-progress answer, the lease, the completion, the release on failure, write-behind
("fast" mode) against completing before returning ("strict"), fingerprints,
``store_result`` and the :class:`~msgpatterns.errors.StoreUnavailable` policy exist
once; only the I/O differs between a sync and an async checker, and between stores.

Two strategies:

* :func:`lease_steps` - a lease store (memory, Redis, SQL): claim with a lease, run,
  complete (compare-and-set) or release (compare-and-delete). A checker's single
  guarded call runs its direct-style twin,
  :func:`~msgpatterns.idempotency.lease_call.lease_call` (sync) or ``alease_call``
  (async), the per-call hot paths, which differential tests hold to exactly what
  ``drive(lease_steps(...))`` and ``adrive(lease_steps(...))`` do;
* :func:`transactional_steps` - the dedup row and the handler's writes in one
  database transaction: claim inside it, run the handler on it, check it can still
  commit, commit (nothing to complete, nothing to release: a rollback undoes both).

The batch form (one ``claim_many`` for many keys, see :func:`claim_many_steps`) is
used by the lease checkers' ``claim_many`` and by batch-aware runtimes.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, NamedTuple, TypeVar

from msgpatterns._escape import escape_control
from msgpatterns.errors import (
    IdempotencyConflict,
    InProgress,
    NeedRetry,
    StoreUnavailable,
    TransactionAborted,
)
from msgpatterns.idempotency.keys import KeyBuilder
from msgpatterns.idempotency.records import DONE, Claim, IdempotencyStats, Record, Status
from msgpatterns.idempotency.results import encode_result, is_not_stored
from msgpatterns.observability import stats as _obs

__all__ = ["Executed", "Io", "Options", "Run", "TransactionAborted", "adrive", "drive",
           "lease_steps", "transactional_steps"]

log = logging.getLogger("msgpatterns.idempotency")

R = TypeVar("R")


class _Tokens:
    """Owner tokens: 64 random bits per process (drawn again after a fork) and a
    64-bit counter; 32 hex characters, unique without a system call per token."""

    def __init__(self) -> None:
        self.reseed()
        os.register_at_fork(after_in_child=self.reseed)

    def reseed(self) -> None:
        self.prefix = os.urandom(8).hex()
        self.counter = itertools.count()

    def __call__(self) -> str:
        return f"{self.prefix}{next(self.counter):016x}"


#: A fresh owner token, unique across processes and hosts.
new_token = _Tokens()


class ClaimRequest(NamedTuple):
    """One key to claim with the token that will own it; to complete, also the result
    text to store with the DONE mark (None: no result)."""

    key: str
    token: str
    fingerprint: str | None
    result: str | None = None


class Executed(NamedTuple, Generic[R]):
    """What a guarded call did: ``ran`` is False when the key was DONE."""

    ran: bool
    result: R | None
    claim: Claim | None


class Options(NamedTuple):
    """How one guarded call treats the rules' choices."""

    fail_open: bool = False
    store_result: bool = False
    max_result_bytes: int = 0
    #: The checker's ``result_key``: stored results are signed and checked with it.
    result_key: bytes | None = None


# -- steps --------------------------------------------------------------------------------


class Io(NamedTuple):
    """A store operation the rules need: ``op`` (a store method's name, or ``queue``
    for write-behind) with ``arg``; ``retried``: transient errors are retried per the
    checker's policy (then :class:`StoreUnavailable`); ``trip``: its name as a
    reported round trip (None: ``op``; "": part of another, not reported)."""

    op: str
    arg: Any
    retried: bool = True
    trip: str | None = None


class Run(NamedTuple):
    """Run the handler, handing it ``tx`` (None on a lease checker)."""

    tx: Any


Steps = Generator["Io | Run", Any, R]


class _Machine(Generic[R]):
    """The steps being driven by :func:`adrive`: ``advance`` hands them the last step's
    reply (or its error) and returns the next step, or None once they returned
    ``value``."""

    __slots__ = ("steps", "value")

    def __init__(self, steps: Steps[R]) -> None:
        self.steps = steps

    def advance(self, reply: Any, error: BaseException | None) -> Io | Run | None:
        try:
            return self.steps.send(reply) if error is None else self.steps.throw(error)
        except StopIteration as stop:
            self.value: R = stop.value
            return None


async def _awaited(step: Io | Run, perform: Callable[[Io], Awaitable[Any]],
                   run: Callable[[Any], Awaitable[Any]]) -> tuple[Any, BaseException | None]:
    try:
        return await (run(step.tx) if type(step) is Run else perform(step)), None  # type: ignore[arg-type]
    except BaseException as exc:  # a CancelledError included: the steps clean up
        return None, exc


def drive(steps: Steps[R], perform: Callable[[Io], Any], run: Callable[[Any], Any]) -> R:
    """Perform ``steps`` synchronously: each :class:`Io` by ``perform``, each
    :class:`Run` by ``run(tx)``; an error of either is thrown back into the steps.
    (The per-message hot path of every sync checker: one loop, no helper calls.)"""
    send, throw = steps.send, steps.throw
    reply: Any = None
    try:
        step = send(None)
        while True:
            try:
                reply = run(step.tx) if type(step) is Run else perform(step)  # type: ignore[arg-type]
            except BaseException as exc:  # handed to the steps, which decide
                step = throw(exc)
            else:
                step = send(reply)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


async def adrive(steps: Steps[R], perform: Callable[[Io], Awaitable[Any]],
                 run: Callable[[Any], Awaitable[Any]]) -> R:
    """:func:`drive` for async checkers: each :class:`Io` and :class:`Run` awaited."""
    machine = _Machine(steps)
    step = machine.advance(None, None)
    while step is not None:
        step = machine.advance(*await _awaited(step, perform, run))
    return machine.value


class RoundTrip:
    """A store round trip of checker ``owner``, reported to the telemetry listener with
    its duration and outcome (nothing when no listener is installed, or ``what`` is
    ""). A context manager for sync and async code alike."""

    __slots__ = ("listener", "owner", "started", "what")

    def __init__(self, owner: str, what: str) -> None:
        self.owner, self.what = owner, what
        self.listener = _obs.listener if what else None
        self.started = time.perf_counter() if self.listener is not None else 0.0

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self.listener is not None:
            _obs.report(self.listener.store_round_trip, self.owner, self.what,
                        time.perf_counter() - self.started, error)


def reported_round_trip(owner: str, what: str, run: Callable[[], R]) -> R:
    """``run()`` as one reported store round trip (see :class:`RoundTrip`)."""
    with RoundTrip(owner, what):
        return run()


# -- the rules ----------------------------------------------------------------------------


#: Claim status -> the IdempotencyStats counter it adds to.
COUNTERS = {Status.CLAIMED: "claimed", Status.DONE: "duplicates",
             Status.IN_PROGRESS: "in_progress", Status.CONFLICT: "conflicts"}


def count_claims(stats: IdempotencyStats, claims: Iterable[Claim]) -> None:
    """Count claims by outcome."""
    stats.add_all(Counter(COUNTERS[claim.status] for claim in claims))


def classify(key: str, record: Record, token: str, fingerprint: str | None) -> Claim:
    """Rule 1's outcome: what a store found after a claim attempt, as a :class:`Claim`."""
    if record.token == token:  # the usual case, built without Claim's Python __new__
        return tuple.__new__(Claim, (key, Status.CLAIMED, token, 0.0, fingerprint, None))
    if fingerprint is not None and record.fingerprint not in (None, fingerprint):
        return Claim(key, Status.CONFLICT)
    if record.state == DONE:
        return Claim(key, Status.DONE, result=record.result)
    return Claim(key, Status.IN_PROGRESS, remaining=max(record.remaining, 0.0))


def skip_or_raise(claim: Claim, store_result: bool = False,
                  result_key: bytes | None = None) -> Executed[Any]:
    """Rules 4 and 5 (and the fingerprint check) for a claim that was not won. With
    ``store_result`` a DONE key's stored result is the outcome's ``result``
    (:class:`~msgpatterns.idempotency.results.ResultNotStored` when it has none,
    ``ResultIntegrityError`` when it fails the ``result_key`` check)."""
    if claim.status is Status.DONE:
        log.debug("duplicate skipped: %s is done", escape_control(claim.key))
        return Executed(False, claim.stored_result(result_key) if store_result else None,
                        claim)
    if claim.status is Status.IN_PROGRESS:
        raise InProgress(
            delay=claim.remaining, reason=f"idempotency key {claim.key!r} is being processed"
        )
    raise IdempotencyConflict(
        f"idempotency key {claim.key!r} was seen with a different payload fingerprint"
    )


def refuse_unavailable(stats: IdempotencyStats, key: str, error: StoreUnavailable, *,
                       fail_open: bool, delay: float) -> NeedRetry | None:
    """Rule 6's verdict for ``key`` (counted): the :class:`NeedRetry` to fail it with,
    or None when the caller opted in to process it WITHOUT dedup (logged)."""
    stats.add("unavailable")
    if not fail_open:
        refusal = NeedRetry(delay=delay, reason=f"idempotency store unavailable: {error}")
        refusal.__cause__ = error
        return refusal
    stats.add("processed_without_dedup")
    log.warning("idempotency store unavailable, processing %s WITHOUT dedup: %s",
                escape_control(key), escape_control(error))
    return None


def with_result(claim: Claim, value: object, stats: IdempotencyStats, max_bytes: int,
                result_key: bytes | None = None) -> Claim:
    """``claim`` carrying ``value``'s stored text (signed with ``result_key`` when
    given), for its completion. A value that cannot be stored (too large, not JSON)
    gives a text saying why: the key is still completed (the effect happened), the
    failure is logged and counted."""
    stored = encode_result(value, max_bytes, claim.key, result_key)
    if is_not_stored(stored):
        stats.add("results_not_stored")
    return claim._replace(result=stored)


def owned_requests(claims: Iterable[Claim]) -> list[ClaimRequest]:
    """The (key, token, fingerprint, result) of each owned claim; refuses claims that
    were not won (nothing to complete or release)."""
    items = []
    for claim in claims:
        if claim.token is None:
            raise ValueError(f"{claim.key!r} was not claimed ({claim.status.value})")
        items.append(ClaimRequest(claim.key, claim.token, claim.fingerprint, claim.result))
    return items


def log_lost(claims: Sequence[Claim], done: Sequence[bool], stats: IdempotencyStats) -> None:
    """Rule 2's bookkeeping: count completions; log each lost lease (not overwritten)."""
    if all(done):
        stats.add("completed", len(done))
        return
    lost = [claim for claim, ok in zip(claims, done, strict=True) if not ok]
    stats.add_all({"completed": len(claims) - len(lost), "lost_leases": len(lost)})
    for claim in lost:
        log.warning(
            "lease on %s expired before completion and another owner took it; its "
            "effect may be applied twice (raise the lease above the handler's longest "
            "run)", escape_control(claim.key),
        )


@dataclass(slots=True)
class LeaseRules:
    """What the lease rules need to know about one checker."""

    keys: KeyBuilder
    stats: IdempotencyStats
    lease: float
    unavailable_delay: float
    #: The write-behind queue's pending completions (fast mode), or None (strict).
    pending: Callable[[str], Claim | None] | None = None


def claim_many_steps(rules: LeaseRules, store_keys: Sequence[str],
                     fingerprints: Sequence[str | None] | None,
                     token: str | None = None) -> Steps[list[Claim]]:
    """Rule 1 for many keys in ONE ``claim_many`` round trip (each distinct key once);
    a key whose completion write-behind still holds is DONE without asking the store.

    ``token`` owns every claimed key when given (a fresh token per key otherwise): a
    key that token holds already comes back ``CLAIMED`` - the claim is re-entrant for
    a caller that may repeat it (a recomputed Spark partition).

    A key repeated within the batch is claimed by its first copy; a later copy is
    classified against what the first found, with its own fingerprint, as a message
    arriving just after it would be: ``IN_PROGRESS`` while the first holds it (held by
    this very batch), the same ``DONE``, or ``CONFLICT`` for another fingerprint.
    Raises :class:`StoreUnavailable` (rule 6 is the caller's).
    """
    prints = list(fingerprints) if fingerprints is not None else [None] * len(store_keys)
    if len(prints) != len(store_keys):
        raise ValueError("one fingerprint per key is needed")
    queued: dict[str, Claim] = {}
    requests: dict[str, ClaimRequest] = {}
    for store_key, fingerprint in zip(store_keys, prints, strict=True):
        held = rules.pending(store_key) if rules.pending is not None else None
        if held is not None:
            queued[store_key] = held
        elif store_key not in requests:
            requests[store_key] = ClaimRequest(store_key, token or new_token(), fingerprint)
    batch = list(requests.values())
    found: list[Record] = (yield Io("claim_many", batch)) if batch else []
    records = dict(zip(requests, found, strict=True))
    claims, seen = [], set()
    for store_key, fingerprint in zip(store_keys, prints, strict=True):
        held = queued.get(store_key)
        if held is not None:  # done here, not written yet
            claim = queued_claim(held, fingerprint)
        elif store_key in seen:  # a later copy: never the owner
            record = records[store_key]
            claim = classify(store_key, record, "", fingerprint)
            if record.token == requests[store_key].token and claim.status is not \
                    Status.CONFLICT:  # held by this very batch (committed or not)
                claim = Claim(store_key, Status.IN_PROGRESS, remaining=rules.lease)
        else:
            claim = classify(store_key, records[store_key], requests[store_key].token,
                             fingerprint)
        seen.add(store_key)
        claims.append(claim)
    count_claims(rules.stats, claims)
    return claims


def queued_claim(held: Claim, fingerprint: str | None) -> Claim:
    """A key whose completion write-behind still holds: DONE (or a CONFLICT for another
    fingerprint) without asking the store."""
    conflict = fingerprint is not None and held.fingerprint not in (None, fingerprint)
    return Claim(held.key, Status.CONFLICT if conflict else Status.DONE, result=held.result)


def claim_one_steps(rules: LeaseRules, store_key: str,
                    fingerprint: str | None) -> Steps[Claim]:
    """:func:`claim_many_steps` for one key (a message's guarded call: its hot path)."""
    held = rules.pending(store_key) if rules.pending is not None else None
    if held is not None:
        claim = queued_claim(held, fingerprint)
    else:
        token = new_token()
        (record,) = yield Io("claim_many", [ClaimRequest(store_key, token, fingerprint)])
        claim = classify(store_key, record, token, fingerprint)
    status = claim.status
    rules.stats.add("claimed" if status is Status.CLAIMED else COUNTERS[status])
    return claim


def complete_steps(rules: LeaseRules, claims: Sequence[Claim]) -> Steps[list[bool]]:
    """Rule 2 for owned claims in one ``complete_many`` round trip (compare-and-set on
    each owner token); a lost lease is counted and logged, never overwritten."""
    items = owned_requests(claims)
    done: list[bool] = (yield Io("complete_many", items)) if items else []
    log_lost(claims, done, rules.stats)
    return done


def release_steps(rules: LeaseRules, claims: Sequence[Claim]) -> Steps[list[bool]]:
    """Rule 3's store part for owned claims: one ``release_many`` round trip
    (compare-and-delete on each owner token)."""
    items = owned_requests(claims)
    released: list[bool] = (yield Io("release_many", items)) if items else []
    rules.stats.add("released", sum(released))
    return released


def lease_steps(rules: LeaseRules, store_key: str, fingerprint: str | None,
                options: Options) -> Steps[Executed[Any]]:
    """The six rules for one call on a lease store.

    Claim (rule 1); a key not won is skipped (4), in progress (5) or a conflict; an
    unreachable store fails with NeedRetry or runs without dedup if opted in (6); the
    handler runs; if it raises, the claim is released and the error propagates (3,
    also for a cancelled async handler); if it returns, the key is completed (2) - now
    (strict) or queued for write-behind (fast). A completion the store refuses to take
    is logged: the effect happened, the lease expires and a later duplicate runs again.
    """
    try:
        claim = yield from claim_one_steps(rules, store_key, fingerprint)
    except StoreUnavailable as exc:
        refusal = refuse_unavailable(rules.stats, store_key, exc,
                                     fail_open=options.fail_open,
                                     delay=rules.unavailable_delay)
        if refusal is not None:
            raise refusal from exc
        return Executed(True, (yield Run(None)), None)
    token = claim.token
    if token is None:
        return skip_or_raise(claim, options.store_result, options.result_key)
    try:
        result = yield Run(None)
    except BaseException:
        try:
            released = yield from release_steps(rules, [claim])
            if not released[0]:
                log_lease_gone(claim.key)
        except StoreUnavailable as exc:
            log_not_released(claim.key, exc)
        raise
    if options.store_result:
        claim = with_result(claim, result, rules.stats, options.max_result_bytes,
                            options.result_key)
    if rules.pending is not None and (yield Io("queue", claim, retried=False)):
        return Executed(True, result, claim)
    try:
        done = yield Io("complete_many", [ClaimRequest(claim.key, token, claim.fingerprint,
                                                       claim.result)])
        log_lost([claim], done, rules.stats)
    except StoreUnavailable as exc:
        log_not_completed(store_key, exc)
    return Executed(True, result, claim)


def log_lease_gone(key: str) -> None:
    """Rule 3: a release found the lease no longer ours."""
    log.debug("release of %s: the lease was no longer ours", escape_control(key))


def log_not_released(key: str, error: StoreUnavailable) -> None:
    """Rule 3: the store stayed unreachable for a release."""
    log.warning("could not release %s (%s); it frees itself when its lease expires",
                escape_control(key), escape_control(error))


def log_not_completed(key: str, error: StoreUnavailable) -> None:
    """Rule 2: the store stayed unreachable for a completion."""
    log.error("effect for %s applied but not recorded as done (%s); the lease will "
              "expire and a duplicate delivered after that applies it again",
              escape_control(key), escape_control(error))


def transactional_steps(stats: IdempotencyStats, store_key: str, fingerprint: str | None,
                        options: Options, unavailable_delay: float) -> Steps[Executed[Any]]:
    """The six rules for one call whose dedup row commits with the handler's writes.

    ``begin`` opens a transaction and claims the key inside it (retried as a whole: rule
    1, or rule 6's NeedRetry); a key not won rolls back and is skipped, in progress or a
    conflict (4, 5); the handler runs on the transaction; if it raises, everything rolls
    back (3: nothing to release); the transaction must still be able to commit (else
    :class:`TransactionAborted`); with ``store_result`` the result is written to the
    dedup row; the commit completes the key (2: nothing to complete afterwards). A
    commit whose outcome is unknown raises NeedRetry: the redelivery finds the key DONE
    or absent. The transaction always ends (``end``: a rollback unless committed).
    """
    request = ClaimRequest(store_key, new_token(), fingerprint)
    try:
        tx, records = yield Io("begin", [request], trip="claim")
    except StoreUnavailable as exc:
        refusal = refuse_unavailable(stats, store_key, exc, fail_open=False,
                                     delay=unavailable_delay)
        assert refusal is not None
        raise refusal from exc
    try:
        claim = classify(store_key, records[0], request.token, fingerprint)
        count_claims(stats, (claim,))
        if claim.token is None:
            return skip_or_raise(claim, options.store_result, options.result_key)
        try:
            result = yield Run(tx)
        except BaseException:
            stats.add("released")
            raise  # ending the transaction below rolls back both
        if (yield Io("aborted", (tx, claim), retried=False, trip="")):
            stats.add("released")
            raise TransactionAborted(
                f"the database aborted the transaction of {claim.key!r} before commit (a "
                "statement failed inside the handler, e.g. an IntegrityError it caught): "
                "nothing was committed and the message will be retried; wrap statements "
                "whose errors the handler handles in tx.begin_nested() (a savepoint)")
        if options.store_result:
            claim = with_result(claim, result, stats, options.max_result_bytes,
                                options.result_key)
            yield Io("store_results", (tx, owned_requests([claim])), retried=False, trip="")
        try:
            yield Io("commit", tx, retried=False)
        except StoreUnavailable as exc:
            stats.add("unavailable")
            raise NeedRetry(delay=unavailable_delay,
                            reason=f"commit of {store_key!r} failed, outcome unknown: "
                                   f"{exc.__cause__!r}") from exc.__cause__
    finally:
        yield Io("end", tx, retried=False, trip="")
    stats.add("completed")
    return Executed(True, result, claim)
