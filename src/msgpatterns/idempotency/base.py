"""The idempotency state machine, written once for every store.

Each key is absent, ``PROCESSING`` (owner token, lease expiry) or ``DONE`` (kept for
``ttl``). The rules, whatever the store:

1. Claim: an absent key, or a ``PROCESSING`` key whose lease expired, becomes
   ``PROCESSING`` with a fresh owner token, atomically.
2. The handler returns: ``PROCESSING`` becomes ``DONE`` only if the owner token still
   matches (compare-and-set). A lost lease is logged and counted, never overwritten.
3. The handler raises: the claim is released only if the token still matches
   (compare-and-delete), and the error propagates.
4. ``DONE``: the handler is skipped and the call counts as a success.
5. ``PROCESSING`` by a live owner: :class:`~msgpatterns.errors.InProgress` with the
   remaining lease as its delay. An in-flight duplicate is never acked as done.
6. The store is unreachable: transient errors are retried, then
   :class:`~msgpatterns.errors.NeedRetry` is raised with a delay. Nothing is
   processed without dedup unless the caller opted in (``fail_open``).

A store subclass of :class:`LeaseChecker` only does I/O: claim a batch of keys and
report what it found, complete or release a batch of (key, token) pairs, purge.

Lease checkers give *at-least-once* effects across crashes: if the process dies after
the handler's effect and before ``complete``, the lease expires and a redelivery
applies the effect again. Only :class:`~msgpatterns.idempotency.TransactionalSqlChecker`
commits the dedup record with the effect and so applies it exactly once.
"""

from __future__ import annotations

import itertools
import logging
import os
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, Protocol, TypeVar, runtime_checkable

from msgpatterns.errors import (
    ConfigurationError,
    IdempotencyConflict,
    InProgress,
    NeedRetry,
    StoreUnavailable,
    seconds,
)
from msgpatterns.idempotency.keys import KeyBuilder
from msgpatterns.idempotency.policy import StorePolicy, call_with_retries
from msgpatterns.idempotency.records import DONE, Claim, IdempotencyStats, Record, Status
from msgpatterns.idempotency.write_behind import WriteBehind

if TYPE_CHECKING:
    from msgpatterns.idempotency.spec import CheckerSpec

__all__ = [
    "Checker",
    "ClaimRequest",
    "Executed",
    "LeaseChecker",
    "claim_batch",
    "classify",
    "count_claims",
    "new_token",
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


#: A fresh owner token, unique across processes and hosts.
new_token = _Tokens()


class ClaimRequest(NamedTuple):
    """One key to claim with the token that will own it."""

    key: str
    token: str
    fingerprint: str | None


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

    def complete(self, claim: Claim) -> bool:
        """Mark a claimed key DONE; False when the lease was lost meanwhile."""
        ...

    def complete_many(self, claims: Sequence[Claim]) -> list[bool]:
        """Complete many claimed keys in one round trip."""
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
    ) -> Executed[R]:
        """Run ``call`` at most once per key, following the six rules."""
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
        return Claim(key, Status.DONE)
    return Claim(key, Status.IN_PROGRESS, remaining=max(record.remaining, 0.0))


def skip_or_raise(checker: Checker, claim: Claim) -> Executed[Any]:
    """Rules 4 and 5 (and the fingerprint check) for a claim that was not won."""
    if claim.status is Status.DONE:
        log.debug("duplicate skipped: %s is done", claim.key)
        return Executed(False, None, claim)
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
    checker.stats.add("unavailable")
    if not fail_open:
        raise NeedRetry(delay=delay, reason=f"idempotency store unavailable: {error}") from error
    checker.stats.add("processed_without_dedup")
    log.warning("idempotency store unavailable, processing %s WITHOUT dedup: %s", key, error)
    return Executed(True, call(None), None)


def claim_batch(
    store_keys: Sequence[str],
    fingerprints: Sequence[str | None] | None,
    claim_records: Callable[[list[ClaimRequest]], list[Record]],
    lease: float,
) -> list[Claim]:
    """Claim ``store_keys`` with one call of ``claim_records`` (each distinct key once).

    A key repeated within the batch is claimed by its first copy; later copies report
    ``IN_PROGRESS`` (held by this very batch) or the first copy's status.
    """
    prints = list(fingerprints) if fingerprints is not None else [None] * len(store_keys)
    if len(prints) != len(store_keys):
        raise ValueError("one fingerprint per key is needed")
    requests: dict[str, ClaimRequest] = {}
    for store_key, fingerprint in zip(store_keys, prints, strict=True):
        if store_key not in requests:
            requests[store_key] = ClaimRequest(store_key, new_token(), fingerprint)
    batch = list(requests.values())
    records = claim_records(batch) if batch else []
    found = {
        request.key: classify(request.key, record, request.token, request.fingerprint)
        for request, record in zip(batch, records, strict=True)
    }
    claims, seen = [], set()
    for store_key in store_keys:
        claim = found[store_key]
        if store_key in seen and claim.status is Status.CLAIMED:
            claim = Claim(store_key, Status.IN_PROGRESS, remaining=lease)
        seen.add(store_key)
        claims.append(claim)
    return claims


_COUNTERS = {Status.CLAIMED: "claimed", Status.DONE: "duplicates",
             Status.IN_PROGRESS: "in_progress", Status.CONFLICT: "conflicts"}


def count_claims(stats: IdempotencyStats, claims: Iterable[Claim]) -> None:
    """Count claims by outcome."""
    stats.add_all(Counter(_COUNTERS[claim.status] for claim in claims))


def _owned(claims: Sequence[Claim]) -> list[ClaimRequest]:
    items = []
    for claim in claims:
        if claim.token is None:
            raise ValueError(f"{claim.key!r} was not claimed ({claim.status.value})")
        items.append(ClaimRequest(claim.key, claim.token, claim.fingerprint))
    return items


class LeaseChecker(ABC):
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
        record if the key is absent (the lease expired and nobody took it). True also
        when it is DONE with that token already (a retried call); False when another
        owner holds it."""

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

    def _close(self) -> None:  # noqa: B027 - optional hook, a no-op for most stores
        """Release the store connections this checker created."""

    # -- public API -------------------------------------------------------------------

    def store_key(self, key: object, group: str = "") -> str:
        return self.keys.build(key, group)

    def _io(self, fn: Callable[[], R], what: str) -> R:
        return call_with_retries(
            fn, self.policy, self.transient, what=f"{type(self).__name__}.{what}",
            on_error=lambda _: self.stats.add("store_errors"),
        )

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

    def complete(self, claim: Claim) -> bool:
        (item,) = _owned([claim])
        done = self._io(lambda: self._complete_record(item), "complete")
        self._after_complete([claim], [done])
        return done

    def complete_many(self, claims: Sequence[Claim]) -> list[bool]:
        items = _owned(claims)
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
        items = _owned(claims)
        released = self._io(lambda: self._release_records(items), "release") if items else []
        self.stats.add("released", sum(released))
        return released

    def execute(
        self, key: object, call: Callable[[Any], R], *, group: str = "",
        fingerprint: str | None = None, fail_open: bool = False,
    ) -> Executed[R]:
        """Run ``call(None)`` unless ``key`` is DONE or in progress (the six rules).

        Raises :class:`InProgress` for a live duplicate, :class:`IdempotencyConflict`
        for a fingerprint mismatch, :class:`NeedRetry` when the store is unreachable
        (unless ``fail_open``), and whatever ``call`` raises (after releasing the key).
        """
        store_key = self.keys.build(key, group)
        queued = self._behind.pending(store_key) if self._behind is not None else None
        if queued is not None:  # done here, its completion not written yet
            conflict = fingerprint is not None and queued.fingerprint not in (None, fingerprint)
            skipped = Claim(store_key, Status.CONFLICT if conflict else Status.DONE)
            self.stats.add(_COUNTERS[skipped.status])
            return skip_or_raise(self, skipped)
        try:
            claim = self._claim(store_key, fingerprint)
        except StoreUnavailable as exc:
            return unavailable(self, store_key, call, exc, fail_open=fail_open,
                               delay=self.policy.unavailable_delay)
        if claim.token is None:
            return skip_or_raise(self, claim)
        try:
            result = call(None)
        except BaseException:
            self._release_quietly(claim)
            raise
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

    def flush(self, timeout: float | None = None) -> bool:
        """Write every completion queued by ``write_behind``; False on timeout."""
        return self._behind.flush(timeout) if self._behind is not None else True

    def close(self) -> None:
        """Write queued completions, then release connections this checker created."""
        if self._behind is not None:
            self._behind.close()
        self._close()

    def _release_quietly(self, claim: Claim) -> None:
        try:
            if not self.release(claim):
                log.debug("release of %s: the lease was no longer ours", claim.key)
        except StoreUnavailable as exc:
            log.warning("could not release %s (%s); it frees itself when its lease "
                        "expires", claim.key, exc)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(namespace={self.namespace!r}, ttl={self.ttl:g}, "
                f"lease={self.lease:g})")
