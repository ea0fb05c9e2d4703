"""The idempotency state machine, written once for every store.

Each key is absent, ``PROCESSING`` (owner token, lease expiry) or ``DONE`` (kept for
``ttl``). The rules, whatever the store:

1. Claim: an absent key, or a ``PROCESSING`` key whose lease expired, becomes
   ``PROCESSING`` with a fresh owner token, atomically.
2. The handler returns: ``PROCESSING`` becomes ``DONE`` only if the owner token still
   matches (compare-and-set). A lost lease is logged and counted, never overwritten.
3. The handler raises: the claim is released only if the token still matches
   (compare-and-delete), and the error propagates.
4. ``DONE``: the handler is skipped and the call counts as a success. With
   ``store_result`` the DONE record keeps the handler's JSON result and a duplicate
   gets it back; a result that cannot be kept (too large, not JSON) never blocks the
   completion - the effect happened, so the key becomes DONE without it (logged) and a
   duplicate raises :class:`~msgpatterns.idempotency.results.ResultNotStored`.
5. ``PROCESSING`` by a live owner: :class:`~msgpatterns.errors.InProgress` with the
   remaining lease as its delay. An in-flight duplicate is never acked as done.
6. The store is unreachable: transient errors are retried, then
   :class:`~msgpatterns.errors.NeedRetry` is raised with a delay. Nothing is
   processed without dedup unless the caller opted in (``fail_open``).

A store subclass of :class:`LeaseChecker` only does I/O: claim a batch of keys and
report what it found (with a DONE record's stored result text), complete (storing each
item's result text, if any) or release a batch of (key, token) pairs, purge.

Lease checkers give *at-least-once* effects across crashes: if the process dies after
the handler's effect and before ``complete``, the lease expires and a redelivery
applies the effect again. Only :class:`~msgpatterns.idempotency.TransactionalSqlChecker`
commits the dedup record with the effect and so applies it exactly once.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, TypeVar, runtime_checkable

from msgpatterns.errors import (
    ConfigurationError,
    IdempotencyConflict,
    InProgress,
    MsgPatternsError,
    NeedRetry,
    StoreUnavailable,
    seconds,
)
from msgpatterns.idempotency.keys import KeyBuilder
from msgpatterns.idempotency.policy import StorePolicy, call_with_retries
from msgpatterns.idempotency.records import DONE, Claim, IdempotencyStats, Record, Status
from msgpatterns.idempotency.results import (
    DEFAULT_MAX_RESULT_BYTES,
    check_max_result_bytes,
    encode_result,
    is_not_stored,
)
from msgpatterns.idempotency.write_behind import WriteBehind
from msgpatterns.observability import stats as _obs

if TYPE_CHECKING:
    from msgpatterns.idempotency.spec import CheckerSpec

__all__ = [
    "Checker",
    "CheckerClosed",
    "ClaimRequest",
    "Closable",
    "Executed",
    "LeaseChecker",
    "NO_RESULT",
    "claim_batch",
    "with_result",
    "classify",
    "count_claims",
    "new_token",
    "refuse_unavailable",
    "skip_or_raise",
    "unavailable",
]

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


def reported_round_trip(owner: str, what: str, run: Callable[[], R]) -> R:
    """``run()``, reported to the telemetry listener as one store round trip of
    checker ``owner`` with its duration and outcome (nothing is done when no listener
    is installed)."""
    listener = _obs.listener
    if listener is None:
        return run()
    started = time.perf_counter()
    error: BaseException | None = None
    try:
        return run()
    except BaseException as exc:
        error = exc
        raise
    finally:
        _obs.report(listener.store_round_trip, owner, what, time.perf_counter() - started,
                    error)


#: A fresh owner token, unique across processes and hosts.
new_token = _Tokens()


class CheckerClosed(MsgPatternsError):
    """A checker was used after its ``close()``: every operation raises this at once."""


class Closable:
    """The closed state every checker shares: after :meth:`_mark_closed`, every
    operation that checks :meth:`_check_open` raises :class:`CheckerClosed`."""

    _closed = False

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise CheckerClosed(f"{type(self).__name__} is closed: build a new checker "
                                "(close() released its connections)")

    def _mark_closed(self) -> bool:
        """Mark closed; False if it already was (close() is idempotent)."""
        if self._closed:
            return False
        self._closed = True
        return True


class ClaimRequest(NamedTuple):
    """One key to claim with the token that will own it; to complete, also the result
    text to store with the DONE mark (None: no result)."""

    key: str
    token: str
    fingerprint: str | None
    result: str | None = None


class _NoResult:
    def __repr__(self) -> str:
        return "NO_RESULT"


#: ``complete(claim)`` without a result to store (None is a result: JSON ``null``).
NO_RESULT: Any = _NoResult()


def with_result(claim: Claim, value: object, stats: IdempotencyStats,
                max_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> Claim:
    """``claim`` carrying ``value``'s stored text, for its completion. A value that
    cannot be stored (too large, not JSON) gives a text saying why: the key is still
    completed (the effect happened), the failure is logged and counted."""
    stored = encode_result(value, max_bytes, claim.key)
    if is_not_stored(stored):
        stats.add("results_not_stored")
    return claim._replace(result=stored)


class Executed(NamedTuple, Generic[R]):
    """What :meth:`Checker.execute` did: ``ran`` is False when the key was DONE."""

    ran: bool
    result: R | None
    claim: Claim | None


@runtime_checkable
class Checker(Protocol):
    """What every checker offers: single and batch calls, and the guarded call used by
    :func:`~msgpatterns.idempotency.idempotent`."""

    namespace: str
    ttl: float
    stats: IdempotencyStats
    #: True when ``execute`` hands the handler a transaction (``tx``).
    passes_tx: bool

    def store_key(self, key: object, group: str = "") -> str:
        """The key as stored for ``key`` in ``group``."""
        ...

    def claim(self, key: object, *, group: str = "", fingerprint: str | None = None) -> Claim:
        """Claim one key (rule 1) and report what was found."""
        ...

    def claim_many(
        self, keys: Sequence[object], *, group: str = "",
        fingerprints: Sequence[str | None] | None = None,
    ) -> list[Claim]:
        """Claim many keys in one round trip; one :class:`Claim` per key, in order."""
        ...

    def complete(self, claim: Claim, result: object = NO_RESULT, *,
                 max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> bool:
        """Mark a claimed key DONE (storing ``result`` as JSON, if given); False when
        the lease was lost meanwhile."""
        ...

    def complete_many(self, claims: Sequence[Claim], results: Sequence[object] | None = None,
                      *, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> list[bool]:
        """Complete many claimed keys in one round trip (with one result per claim, if
        given)."""
        ...

    def release(self, claim: Claim) -> bool:
        """Give a claimed key back (it becomes absent); False if no longer owned."""
        ...

    def release_many(self, claims: Sequence[Claim]) -> list[bool]:
        """Release many claimed keys in one round trip."""
        ...

    def execute(
        self, key: object, call: Callable[[Any], R], *, group: str = "",
        fingerprint: str | None = None, fail_open: bool = False,
        store_result: bool = False, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    ) -> Executed[R]:
        """Run ``call`` at most once per key, following the six rules; with
        ``store_result`` a duplicate's ``Executed.result`` is the stored result."""
        ...

    def purge(self, older_than: float | timedelta | None = None) -> int:
        """Delete records that expired at least ``older_than`` ago; returns how many."""
        ...

    def spec(self) -> CheckerSpec:
        """A picklable description from which another process rebuilds this checker."""
        ...

    def close(self) -> None:
        """Release connections this checker created."""
        ...


def classify(key: str, record: Record, token: str, fingerprint: str | None) -> Claim:
    """Turn what a store found after a claim attempt into a :class:`Claim`."""
    if record.token == token:
        return Claim(key, Status.CLAIMED, token, fingerprint=fingerprint)
    if fingerprint is not None and record.fingerprint not in (None, fingerprint):
        return Claim(key, Status.CONFLICT)
    if record.state == DONE:
        return Claim(key, Status.DONE, result=record.result)
    return Claim(key, Status.IN_PROGRESS, remaining=max(record.remaining, 0.0))


def skip_or_raise(checker: Checker, claim: Claim, store_result: bool = False) -> Executed[Any]:
    """Rules 4 and 5 (and the fingerprint check) for a claim that was not won. With
    ``store_result`` a DONE key's stored result is the outcome's ``result``
    (:class:`~msgpatterns.idempotency.results.ResultNotStored` when it has none)."""
    if claim.status is Status.DONE:
        log.debug("duplicate skipped: %s is done", claim.key)
        return Executed(False, claim.stored_result() if store_result else None, claim)
    if claim.status is Status.IN_PROGRESS:
        raise InProgress(
            delay=claim.remaining, reason=f"idempotency key {claim.key!r} is being processed"
        )
    raise IdempotencyConflict(
        f"idempotency key {claim.key!r} was seen with a different payload fingerprint"
    )


def unavailable(
    checker: Checker, key: str, call: Callable[[Any], R], error: StoreUnavailable,
    *, fail_open: bool, delay: float,
) -> Executed[R]:
    """Rule 6 once retries are exhausted: NeedRetry, or run undeduplicated if opted in."""
    refusal = refuse_unavailable(checker, key, error, fail_open=fail_open, delay=delay)
    if refusal is not None:
        raise refusal from error
    return Executed(True, call(None), None)


def refuse_unavailable(checker: Checker, key: str, error: StoreUnavailable, *,
                       fail_open: bool, delay: float) -> NeedRetry | None:
    """Rule 6's verdict for ``key`` (counted): the :class:`NeedRetry` to fail it with,
    or None when the caller opted in to process it WITHOUT dedup (logged)."""
    checker.stats.add("unavailable")
    if not fail_open:
        refusal = NeedRetry(delay=delay, reason=f"idempotency store unavailable: {error}")
        refusal.__cause__ = error
        return refusal
    checker.stats.add("processed_without_dedup")
    log.warning("idempotency store unavailable, processing %s WITHOUT dedup: %s", key, error)
    return None


def claim_batch(
    store_keys: Sequence[str],
    fingerprints: Sequence[str | None] | None,
    claim_records: Callable[[list[ClaimRequest]], list[Record]],
    lease: float,
) -> list[Claim]:
    """Claim ``store_keys`` with one call of ``claim_records`` (each distinct key once).

    A key repeated within the batch is claimed by its first copy; a later copy is
    classified against what the first found, with its own fingerprint, as a message
    arriving just after it would be: ``IN_PROGRESS`` while the first holds it (held by
    this very batch), the same ``DONE``, or ``CONFLICT`` for another fingerprint.
    """
    prints = list(fingerprints) if fingerprints is not None else [None] * len(store_keys)
    if len(prints) != len(store_keys):
        raise ValueError("one fingerprint per key is needed")
    requests: dict[str, ClaimRequest] = {}
    for store_key, fingerprint in zip(store_keys, prints, strict=True):
        if store_key not in requests:
            requests[store_key] = ClaimRequest(store_key, new_token(), fingerprint)
    batch = list(requests.values())
    records = dict(zip(requests, claim_records(batch), strict=True)) if batch else {}
    claims, seen = [], set()
    for store_key, fingerprint in zip(store_keys, prints, strict=True):
        record = records[store_key]
        if store_key in seen:  # a later copy: never the owner
            claim = classify(store_key, record, "", fingerprint)
            if record.token == requests[store_key].token and claim.status is not \
                    Status.CONFLICT:  # held by this very batch (committed or not)
                claim = Claim(store_key, Status.IN_PROGRESS, remaining=lease)
        else:
            claim = classify(store_key, record, requests[store_key].token, fingerprint)
        seen.add(store_key)
        claims.append(claim)
    return claims


_COUNTERS = {Status.CLAIMED: "claimed", Status.DONE: "duplicates",
             Status.IN_PROGRESS: "in_progress", Status.CONFLICT: "conflicts"}


def count_claims(stats: IdempotencyStats, claims: Iterable[Claim]) -> None:
    """Count claims by outcome."""
    stats.add_all(Counter(_COUNTERS[claim.status] for claim in claims))


def owned_requests(claims: Sequence[Claim]) -> list[ClaimRequest]:
    items = []
    for claim in claims:
        if claim.token is None:
            raise ValueError(f"{claim.key!r} was not claimed ({claim.status.value})")
        items.append(ClaimRequest(claim.key, claim.token, claim.fingerprint, claim.result))
    return items


def attach_results(claims: Sequence[Claim], results: Sequence[object] | None,
                   stats: IdempotencyStats, max_bytes: int) -> Sequence[Claim]:
    """``claims`` carrying one result each (``results``), or as they are (None)."""
    if results is None:
        return claims
    check_max_result_bytes(max_bytes)
    if len(results) != len(claims):
        raise ValueError("one result per claim is needed")
    return [with_result(claim, value, stats, max_bytes)
            for claim, value in zip(claims, results, strict=True)]


class LeaseChecker(Closable, ABC):
    """Base of the checkers that hold a key with a lease while the handler runs.

    Subclasses implement the store I/O (``_claim_records``, ``_complete_records``,
    ``_release_records``, ``purge``, ``spec``) and declare ``transient``, the error
    types worth retrying. Everything else - tokens, classification, the six rules,
    retries, counters - lives here.
    """

    passes_tx = False
    #: Store errors that are retried (connection lost, timeout, lock wait...).
    transient: tuple[type[BaseException], ...] = ()

    def __init__(
        self,
        *,
        namespace: str,
        ttl: float | timedelta,
        lease: float | timedelta,
        max_key_bytes: int | None,
        policy: StorePolicy | None,
        write_behind: float | timedelta | None = None,
    ) -> None:
        self.ttl = seconds(ttl) or 0.0
        self.lease = seconds(lease) or 0.0
        if self.ttl <= 0 or self.lease <= 0:
            raise ConfigurationError("ttl and lease must be positive")
        self.namespace = namespace
        self.keys = KeyBuilder(namespace, max_key_bytes)
        self.policy = policy if policy is not None else StorePolicy()
        self.stats = IdempotencyStats()
        self.stats.owner = type(self).__name__
        interval = seconds(write_behind)
        if interval is not None and not 0 < interval < self.lease:
            raise ConfigurationError("write_behind must be positive and shorter than the lease")
        self.write_behind = interval
        self._behind = WriteBehind(self, interval) if interval is not None else None

    # -- store I/O --------------------------------------------------------------------

    @abstractmethod
    def _claim_records(self, requests: Sequence[ClaimRequest]) -> list[Record]:
        """Claim every request's key (distinct keys) atomically per key, in one round
        trip; return each key's record as it stands after the attempt."""

    def _claim_record(self, request: ClaimRequest) -> Record:
        return self._claim_records([request])[0]

    @abstractmethod
    def _complete_records(self, items: Sequence[ClaimRequest]) -> list[bool]:
        """Per claimed item: PROCESSING -> DONE (ttl) if the token matches, or a new DONE
        record if the key is absent (the lease expired and nobody took it), keeping the
        item's ``result`` text with it when there is one. True also when it is DONE
        with that token already (a retried call); False when another owner holds it."""

    def _complete_record(self, item: ClaimRequest) -> bool:
        return self._complete_records([item])[0]

    @abstractmethod
    def _release_records(self, items: Sequence[ClaimRequest]) -> list[bool]:
        """Per claimed item: delete the PROCESSING record if the token matches."""

    @abstractmethod
    def purge(self, older_than: float | timedelta | None = None) -> int:
        """Delete records that expired at least ``older_than`` ago."""

    @abstractmethod
    def spec(self) -> CheckerSpec:
        """A picklable description of this checker."""

    def _close(self) -> None:  # an optional hook, a no-op for most stores
        """Release the store connections this checker created."""

    # -- public API -------------------------------------------------------------------

    def store_key(self, key: object, group: str = "") -> str:
        return self.keys.build(key, group)

    def _io(self, fn: Callable[[], R], what: str) -> R:
        """One store operation (a round trip, retried on transient errors); reported
        to the telemetry listener with its duration when one is installed."""
        self._check_open()
        return reported_round_trip(self.stats.owner, what, lambda: call_with_retries(
            fn, self.policy, self.transient, what=f"{type(self).__name__}.{what}",
            on_error=lambda _: self.stats.add("store_errors"),
        ))

    def claim(self, key: object, *, group: str = "", fingerprint: str | None = None) -> Claim:
        return self._claim(self.keys.build(key, group), fingerprint)

    def _claim(self, store_key: str, fingerprint: str | None) -> Claim:
        request = ClaimRequest(store_key, new_token(), fingerprint)
        record = self._io(lambda: self._claim_record(request), "claim")
        claim = classify(store_key, record, request.token, fingerprint)
        self.stats.add(_COUNTERS[claim.status])
        return claim

    def claim_many(
        self, keys: Sequence[object], *, group: str = "",
        fingerprints: Sequence[str | None] | None = None,
    ) -> list[Claim]:
        claims = claim_batch(
            self.keys.build_many(keys, group), fingerprints,
            lambda batch: self._io(lambda: self._claim_records(batch), "claim_many"),
            self.lease,
        )
        count_claims(self.stats, claims)
        return claims

    def complete(self, claim: Claim, result: object = NO_RESULT, *,
                 max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> bool:
        """Mark ``claim``'s key DONE; with ``result``, store it (as JSON) for duplicates.

        A result too large or not JSON-serialisable is not stored, but the key is
        completed all the same (the effect happened): logged, counted in
        ``stats.results_not_stored``, and a duplicate raises ``ResultNotStored``.
        """
        if result is not NO_RESULT:
            claim = attach_results([claim], [result], self.stats, max_result_bytes)[0]
        (item,) = owned_requests([claim])
        done = self._io(lambda: self._complete_record(item), "complete")
        self._after_complete([claim], [done])
        return done

    def complete_many(self, claims: Sequence[Claim], results: Sequence[object] | None = None,
                      *, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> list[bool]:
        """:meth:`complete` for many claims in one round trip; ``results``: one per
        claim, stored with it."""
        claims = attach_results(claims, results, self.stats, max_result_bytes)
        items = owned_requests(claims)
        done = self._io(lambda: self._complete_records(items), "complete_many") if items else []
        self._after_complete(claims, done)
        return done

    def _after_complete(self, claims: Sequence[Claim], done: Sequence[bool]) -> None:
        lost = [claim for claim, ok in zip(claims, done, strict=True) if not ok]
        self.stats.add_all({"completed": len(claims) - len(lost), "lost_leases": len(lost)})
        for claim in lost:
            log.warning(
                "lease on %s expired before completion and another owner took it; its "
                "effect may be applied twice (raise the lease above the handler's longest "
                "run)", claim.key,
            )

    def release(self, claim: Claim) -> bool:
        return self.release_many([claim])[0]

    def release_many(self, claims: Sequence[Claim]) -> list[bool]:
        items = owned_requests(claims)
        released = self._io(lambda: self._release_records(items), "release") if items else []
        self.stats.add("released", sum(released))
        return released

    def execute(
        self, key: object, call: Callable[[Any], R], *, group: str = "",
        fingerprint: str | None = None, fail_open: bool = False,
        store_result: bool = False, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    ) -> Executed[R]:
        """Run ``call(None)`` unless ``key`` is DONE or in progress (the six rules).

        With ``store_result`` the call's result is kept (as JSON, at most
        ``max_result_bytes``) with the DONE mark, and a duplicate's
        ``Executed.result`` is that stored value.

        Raises :class:`InProgress` for a live duplicate, :class:`IdempotencyConflict`
        for a fingerprint mismatch, :class:`NeedRetry` when the store is unreachable
        (unless ``fail_open``), ``ResultNotStored`` for a duplicate (with
        ``store_result``) whose DONE record has no result, and whatever ``call``
        raises (after releasing the key). :class:`CheckerClosed` after :meth:`close`.
        """
        self._check_open()
        if store_result:
            check_max_result_bytes(max_result_bytes)
        store_key = self.keys.build(key, group)
        skipped = self._queued(store_key, fingerprint)
        if skipped is not None:
            self.stats.add(_COUNTERS[skipped.status])
            return skip_or_raise(self, skipped, store_result)
        try:
            claim = self._claim(store_key, fingerprint)
        except StoreUnavailable as exc:
            return unavailable(self, store_key, call, exc, fail_open=fail_open,
                               delay=self.policy.unavailable_delay)
        if claim.token is None:
            return skip_or_raise(self, claim, store_result)
        try:
            result = call(None)
        except BaseException:
            self._release_quietly(claim)
            raise
        if store_result:
            claim = with_result(claim, result, self.stats, max_result_bytes)
        if self._behind is not None and self._behind.add(claim):
            return Executed(True, result, claim)
        try:
            self.complete(claim)
        except StoreUnavailable as exc:
            log.error(
                "effect for %s applied but not recorded as done (%s); the lease will "
                "expire and a duplicate delivered after that applies it again", store_key, exc,
            )
        return Executed(True, result, claim)

    def _queued(self, store_key: str, fingerprint: str | None) -> Claim | None:
        """A key whose completion write-behind still holds: done here, not written yet
        (DONE, or CONFLICT for another fingerprint); None otherwise."""
        queued = self._behind.pending(store_key) if self._behind is not None else None
        if queued is None:
            return None
        conflict = fingerprint is not None and queued.fingerprint not in (None, fingerprint)
        return Claim(store_key, Status.CONFLICT if conflict else Status.DONE,
                     result=queued.result)

    # -- batches of guarded calls (a runtime running many messages at once) -----------

    def claim_stored(self, store_keys: Sequence[str],
                     fingerprints: Sequence[str | None]) -> list[Claim]:
        """Rule 1 for many keys already built (:meth:`store_key`): one ``claim_many``
        round trip; a key whose completion write-behind still holds is reported DONE
        without asking the store. Raises :class:`StoreUnavailable` (rule 6 is the
        caller's: :func:`refuse_unavailable`)."""
        self._check_open()
        pairs = zip(store_keys, fingerprints, strict=True)
        claims: list[Claim | None] = (
            [self._queued(key, fingerprint) for key, fingerprint in pairs]
            if self._behind is not None else [None] * len(store_keys))
        asked = [i for i, claim in enumerate(claims) if claim is None]
        if len(asked) < len(claims):
            count_claims(self.stats, [c for c in claims if c is not None])
        if asked:
            found = claim_batch(
                [store_keys[i] for i in asked], [fingerprints[i] for i in asked],
                lambda batch: self._io(lambda: self._claim_records(batch), "claim_many"),
                self.lease,
            )
            count_claims(self.stats, found)
            for i, claim in zip(asked, found, strict=True):
                claims[i] = claim
        return [claim for claim in claims if claim is not None]

    def complete_ran(self, claims: Sequence[Claim]) -> None:
        """Rule 2 for many handlers that returned: their claims become DONE in one
        ``complete_many`` round trip (or are queued, with ``write_behind``). A store
        that stays unreachable is logged, not raised: the effects happened, so the
        leases expire and duplicates delivered after that apply them again."""
        behind = self._behind
        if behind is not None:
            claims = [claim for claim in claims if not behind.add(claim)]
        if not claims:
            return
        try:
            self.complete_many(claims)
        except StoreUnavailable as exc:
            log.error(
                "effects for %d key(s) applied but not recorded as done (%s); their leases "
                "will expire and duplicates delivered after that apply them again",
                len(claims), exc,
            )

    def release_failed(self, claims: Sequence[Claim]) -> None:
        """Rule 3 for many handlers that raised: one ``release_many`` round trip
        (compare-and-delete on each owner token). A store that stays unreachable is
        logged: the keys free themselves when their leases expire."""
        if not claims:
            return
        try:
            self.release_many(claims)
        except StoreUnavailable as exc:
            log.warning("could not release %d key(s) (%s); they free themselves when "
                        "their leases expire", len(claims), exc)

    def flush(self, timeout: float | None = None) -> bool:
        """Write every completion queued by ``write_behind``; False on timeout."""
        return self._behind.flush(timeout) if self._behind is not None else True

    def close(self) -> None:
        """Write queued completions, then release connections this checker created.

        Afterwards every operation raises :class:`CheckerClosed`; a second call does
        nothing. A client or engine the caller passed in is left open.
        """
        if self._closed:
            return
        if self._behind is not None:
            self._behind.close()
        if self._mark_closed():
            self._close()

    def _release_quietly(self, claim: Claim) -> None:
        try:
            if not self.release(claim):
                log.debug("release of %s: the lease was no longer ours", claim.key)
        except StoreUnavailable as exc:
            log.warning("could not release %s (%s); it frees itself when its lease "
                        "expires", claim.key, exc)

    def _where(self) -> str:
        """Where the store is, credentials redacted ("" when in process)."""
        return ""

    def __repr__(self) -> str:
        where = self._where()
        where = f"{where!r}, " if where else ""
        return (f"{type(self).__name__}({where}namespace={self.namespace!r}, "
                f"ttl={self.ttl:g}, lease={self.lease:g})")
