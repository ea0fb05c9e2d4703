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

The rules are applied once, by :mod:`msgpatterns.idempotency.guard`, for every store
(:mod:`msgpatterns.idempotency.store`: claim, complete, release in batch form) and for
sync and async checkers alike. A checker is a store, the guard, and a driver.

Lease checkers give *at-least-once* effects across crashes: if the process dies after
the handler's effect and before ``complete``, the lease expires and a redelivery
applies the effect again. Only :class:`~msgpatterns.idempotency.TransactionalSqlChecker`
commits the dedup record with the effect and so applies it exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, Self, TypedDict, TypeVar, runtime_checkable

from msgpatterns.errors import CheckerClosed, ConfigurationError, StoreUnavailable, seconds
from msgpatterns.idempotency.guard import (
    ClaimRequest,
    Executed,
    Io,
    LeaseRules,
    Options,
    RoundTrip,
    Steps,
    adrive,
    claim_many_steps,
    complete_steps,
    drive,
    new_token,
    release_steps,
    with_result,
)
from msgpatterns.idempotency.keys import KeyBuilder
from msgpatterns.idempotency.lease_call import alease_call, lease_call
from msgpatterns.idempotency.policy import (
    StorePolicy,
    acall_with_retries,
    aretry_after,
    call_with_retries,
    retry_after,
)
from msgpatterns.idempotency.records import Claim, IdempotencyStats
from msgpatterns.idempotency.results import (
    DEFAULT_MAX_RESULT_BYTES,
    SignsResults,
    check_max_result_bytes,
)
from msgpatterns.idempotency.spec import Checker, CheckerSpec
from msgpatterns.idempotency.write_behind import AsyncWriteBehind, WriteBehind
from msgpatterns.observability import stats as _obs

if TYPE_CHECKING:
    from msgpatterns.idempotency.store import AsyncStore, Store

__all__ = [
    "NO_RESULT",
    "AsyncChecker",
    "AsyncLeaseChecker",
    "AsyncOptions",
    "BatchChecker",
    "Checker",
    "CheckerClosed",
    "ClaimRequest",
    "Closable",
    "Executed",
    "LeaseChecker",
    "new_token",
]

log = logging.getLogger("msgpatterns.idempotency")

R = TypeVar("R")


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


class _NoResult:
    def __repr__(self) -> str:
        return "NO_RESULT"


#: ``complete(claim)`` without a result to store (None is a result: JSON ``null``).
NO_RESULT: Any = _NoResult()


@runtime_checkable
class BatchChecker(Checker, Protocol):
    """A checker with batch claims (the lease checkers): for batch and Spark use."""

    def claim_many(
        self, keys: Sequence[object], *, group: str = "",
        fingerprints: Sequence[str | None] | None = None,
    ) -> list[Claim]:
        """Claim many keys in one round trip; one :class:`Claim` per key, in order."""
        ...

    def complete_many(self, claims: Sequence[Claim], results: Sequence[object] | None = None,
                      *, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> list[bool]:
        """Complete many claimed keys in one round trip."""
        ...

    def release_many(self, claims: Sequence[Claim]) -> list[bool]:
        """Release many claimed keys in one round trip."""
        ...


@runtime_checkable
class AsyncChecker(Protocol):
    """What ``@idempotent`` calls on a checker for ``async def`` handlers."""

    namespace: str
    stats: IdempotencyStats
    passes_tx: bool

    def store_key(self, key: object, group: str = "") -> str:
        """The key as stored for ``key`` in ``group``."""
        ...

    async def aexecute(
        self, key: object, call: Callable[[Any], Awaitable[R]], *, group: str = "",
        fingerprint: str | None = None, fail_open: bool = False,
        store_result: bool = False, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    ) -> Executed[R]:
        """Await ``call`` at most once per key, following the same six rules."""
        ...

    async def aclose(self) -> None:
        """Release connections this checker created."""
        ...


class AsyncOptions(TypedDict, total=False):
    """The keyword options of the async checkers, as their sync forms take them
    (``ttl``, ``lease``, ``namespace``, ``policy``, ``write_behind``; ``clock`` for SQL,
    ``max_key_bytes`` for Redis): an async checker takes its sync form's defaults."""

    namespace: str
    ttl: float | timedelta
    lease: float | timedelta
    policy: StorePolicy | None
    write_behind: float | timedelta | None
    clock: Callable[[], float]
    max_key_bytes: int


def checker_options(fail_open: bool, store_result: bool, max_result_bytes: int,
                    result_key: bytes | None = None) -> Options:
    """A checker's constructor options, checked (``max_result_bytes`` when results are
    stored). The same options are the same object (kept: a guarded call's hot path)."""
    cache_key = (fail_open, store_result, max_result_bytes, result_key)
    found = _OPTIONS.get(cache_key)
    if found is not None:
        return found
    if store_result:
        check_max_result_bytes(max_result_bytes)
    options = Options(fail_open, store_result, max_result_bytes, result_key)
    if len(_OPTIONS) < 256:
        _OPTIONS[cache_key] = options
    return options


_OPTIONS: dict[tuple[bool, bool, int, bytes | None], Options] = {}


def attach_results(claims: Sequence[Claim], results: Sequence[object] | None,
                   stats: IdempotencyStats, max_bytes: int,
                   result_key: bytes | None = None) -> Sequence[Claim]:
    """``claims`` carrying one result each (``results``, signed with ``result_key``
    when given), or as they are (None)."""
    if results is None:
        return claims
    check_max_result_bytes(max_bytes)
    if len(results) != len(claims):
        raise ValueError("one result per claim is needed")
    return [with_result(claim, value, stats, max_bytes, result_key)
            for claim, value in zip(claims, results, strict=True)]


def perform_io(operation: Callable[[Any], R], io: Io, policy: StorePolicy,
               transient: tuple[type[BaseException], ...], stats: IdempotencyStats) -> R:
    """``operation(io.arg)``: one store round trip, reported to the telemetry listener,
    retried on ``transient`` errors per ``policy`` when ``io.retried`` (then
    :class:`StoreUnavailable`)."""
    if _obs.listener is None and io.retried:  # the hot path: nothing to report
        return call_with_retries(partial(operation, io.arg), policy, transient,
                                 what=f"{stats.owner}.{io.op}", on_error=stats.count_error)
    with RoundTrip(stats.owner, io.op if io.trip is None else io.trip):
        if not io.retried:
            return operation(io.arg)
        return call_with_retries(partial(operation, io.arg), policy, transient,
                                 what=f"{stats.owner}.{io.op}", on_error=stats.count_error)


async def aperform_io(operation: Callable[[Any], Awaitable[R]], io: Io, policy: StorePolicy,
                      transient: tuple[type[BaseException], ...],
                      stats: IdempotencyStats) -> R:
    """:func:`perform_io` for an async store operation."""
    if _obs.listener is None and io.retried:  # the hot path: nothing to report
        return await acall_with_retries(partial(operation, io.arg), policy, transient,
                                        what=f"{stats.owner}.{io.op}",
                                        on_error=stats.count_error)
    with RoundTrip(stats.owner, io.op if io.trip is None else io.trip):
        return await (acall_with_retries(lambda: operation(io.arg), policy, transient,
                                         what=f"{stats.owner}.{io.op}",
                                         on_error=stats.count_error)
                      if io.retried else operation(io.arg))


def _no_handler(tx: Any) -> Any:
    raise AssertionError("these steps run no handler")


class _LeaseBase(Closable, SignsResults):
    """What every lease checker holds: keys, ttl and lease, the store policy, counters,
    and the guard's view of them (:class:`~msgpatterns.idempotency.guard.LeaseRules`)."""

    passes_tx = False

    def __init__(
        self,
        *,
        ttl: float | timedelta,
        lease: float | timedelta,
        max_key_bytes: int | None,
        namespace: str = "msgpatterns",
        policy: StorePolicy | None = None,
        write_behind: float | timedelta | None = None,
    ) -> None:
        self.ttl = seconds(ttl) or 0.0
        self.lease = seconds(lease) or 0.0
        if self.ttl <= 0 or self.lease <= 0:
            raise ConfigurationError("ttl and lease must be positive")
        self.namespace = namespace
        self.keys = KeyBuilder(namespace, max_key_bytes)
        self.stats = IdempotencyStats()
        self.stats.owner = type(self).__name__
        interval = seconds(write_behind)
        if interval is not None and not 0 < interval < self.lease:
            raise ConfigurationError("write_behind must be positive and shorter than the lease")
        self.write_behind = interval
        self.rules = LeaseRules(self.keys, self.stats, self.lease, 0.0)
        self.policy = policy if policy is not None else StorePolicy()

    @property
    def policy(self) -> StorePolicy:
        """Retries of an unreachable store, and the NeedRetry delay after them."""
        return self._policy

    @policy.setter
    def policy(self, policy: StorePolicy) -> None:
        self._policy = policy
        self.rules.unavailable_delay = policy.unavailable_delay

    def store_key(self, key: object, group: str = "") -> str:
        return self.keys.build(key, group)

    def _where(self) -> str:
        """Where the store is, credentials redacted ("" when in process)."""
        return ""

    def __repr__(self) -> str:
        where = self._where()
        where = f"{where!r}, " if where else ""
        return (f"{type(self).__name__}({where}namespace={self.namespace!r}, "
                f"ttl={self.ttl:g}, lease={self.lease:g})")


class LeaseChecker(_LeaseBase):
    """Base of the sync checkers that hold a key with a lease while the handler runs.

    A subclass builds its :class:`~msgpatterns.idempotency.store.Store` (``store``,
    with the store's ``transient`` errors) and implements ``purge`` and ``spec``;
    the rules, tokens, retries and counters are the guard's.
    """

    store: Store

    def __init__(self, store: Store, **options: Any) -> None:
        super().__init__(**options)
        self.store = store
        self._behind = WriteBehind(self, self.write_behind) \
            if self.write_behind is not None else None
        if self._behind is not None:
            self.rules.pending = self._behind.pending

    @property
    def transient(self) -> tuple[type[BaseException], ...]:
        """Store errors that are retried (connection lost, timeout, lock wait...)."""
        return self.store.transient

    def _perform(self, io: Io) -> Any:
        """One store operation the guard asked for: a round trip, retried on transient
        errors, reported to the telemetry listener (:func:`perform_io`)."""
        if self._closed:
            self._check_open()
        op = io.op
        if op == "queue":
            return self._behind is not None and self._behind.add(io.arg)
        operation = getattr(self.store, op)
        if _obs.listener is not None or not io.retried:
            return perform_io(operation, io, self._policy, self.store.transient, self.stats)
        # the hot path, perform_io's first attempt inline: nothing to report, and the
        # retries' description built only when they are needed
        transient = self.store.transient
        try:
            return operation(io.arg)
        except transient as exc:
            first: BaseException = exc
        return retry_after(first, partial(operation, io.arg), self._policy, transient,
                           what=f"{self.stats.owner}.{op}", on_error=self.stats.count_error)

    def _drive(self, steps: Steps[R]) -> R:
        return drive(steps, self._perform, _no_handler)

    # -- public API -------------------------------------------------------------------

    def claim(self, key: object, *, group: str = "", fingerprint: str | None = None) -> Claim:
        """Claim one key (rule 1) and report what was found."""
        return self.claim_many([key], group=group,
                               fingerprints=None if fingerprint is None else [fingerprint])[0]

    def claim_many(
        self, keys: Sequence[object], *, group: str = "",
        fingerprints: Sequence[str | None] | None = None, token: str | None = None,
    ) -> list[Claim]:
        """Claim many keys in one round trip; one :class:`Claim` per key, in order.

        ``token``: the owner token of every key claimed (default: a fresh one each).
        A key this token holds already is ``CLAIMED`` again, so a caller that may
        repeat the same claim (a recomputed Spark partition) gets its claims back
        instead of finding its own keys in progress. Use a token once per unit of work.
        """
        self._check_open()
        return self._drive(claim_many_steps(self.rules, self.keys.build_many(keys, group),
                                            fingerprints, token))

    def complete(self, claim: Claim, result: object = NO_RESULT, *,
                 max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> bool:
        """Mark ``claim``'s key DONE; with ``result``, store it (as JSON) for duplicates.

        A result too large or not JSON-serialisable is not stored, but the key is
        completed all the same (the effect happened): logged, counted in
        ``stats.results_not_stored``, and a duplicate raises ``ResultNotStored``.
        False when the lease was lost meanwhile.
        """
        results = None if result is NO_RESULT else [result]
        return self.complete_many([claim], results, max_result_bytes=max_result_bytes)[0]

    def complete_many(self, claims: Sequence[Claim], results: Sequence[object] | None = None,
                      *, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> list[bool]:
        """:meth:`complete` for many claims in one round trip; ``results``: one per
        claim, stored with it."""
        self._check_open()
        claims = attach_results(claims, results, self.stats, max_result_bytes,
                                self.result_key)
        return self._drive(complete_steps(self.rules, claims))

    def release(self, claim: Claim) -> bool:
        """Give a claimed key back (it becomes absent); False if no longer owned."""
        return self.release_many([claim])[0]

    def release_many(self, claims: Sequence[Claim]) -> list[bool]:
        """Release many claimed keys in one round trip."""
        self._check_open()
        return self._drive(release_steps(self.rules, claims))

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
        # lease_steps in direct style (the sync hot path; differential-tested against
        # drive(lease_steps(...)))
        return lease_call(self.rules, self._perform, self.keys.build(key, group),
                          fingerprint, checker_options(fail_open, store_result, max_result_bytes,
                                                        self.result_key), call)

    def purge(self, older_than: float | timedelta | None = None) -> int:  # pragma: no cover
        """Delete records that expired at least ``older_than`` ago; returns how many."""
        raise NotImplementedError

    def spec(self) -> CheckerSpec:  # pragma: no cover - every store defines it
        """A picklable description of this checker."""
        raise NotImplementedError

    # -- batches of guarded calls (a runtime running many messages at once) -----------

    def claim_stored(self, store_keys: Sequence[str],
                     fingerprints: Sequence[str | None]) -> list[Claim]:
        """Rule 1 for many keys already built (:meth:`store_key`): one ``claim_many``
        round trip; a key whose completion write-behind still holds is reported DONE
        without asking the store. Raises :class:`StoreUnavailable` (rule 6 is the
        caller's)."""
        self._check_open()
        return self._drive(claim_many_steps(self.rules, store_keys, fingerprints))

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

    def _close(self) -> None:  # an optional hook, a no-op for most stores
        """Release the store connections this checker created."""

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

    def __enter__(self) -> Self:
        """``with checker:`` - the block's end calls :meth:`close`."""
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncDriver:
    """The async driver of the lease rules: ``aexecute`` awaits the store (``astore``,
    an :class:`~msgpatterns.idempotency.store.AsyncStore`) and the handler. Mixed into
    the async checkers (and :class:`MemoryChecker`, which serves both kinds)."""

    astore: AsyncStore
    rules: LeaseRules
    policy: StorePolicy
    stats: IdempotencyStats
    keys: KeyBuilder
    write_behind: float | None
    result_key: bytes | None
    _abehind: AsyncWriteBehind | None = None

    if TYPE_CHECKING:  # provided by the checker it is mixed into
        _closed: bool

        def _check_open(self) -> None: ...

    async def _aperform(self, io: Io) -> Any:
        """One store operation the guard asked for, awaited (see ``_perform``)."""
        if self._closed:
            self._check_open()
        op = io.op
        if op == "queue":
            return await self._async_behind().add(io.arg)
        operation = getattr(self.astore, op)
        if _obs.listener is not None or not io.retried:
            return await aperform_io(operation, io, self.policy, self.astore.transient,
                                     self.stats)
        transient = self.astore.transient  # the hot path, as in _perform
        try:
            return await operation(io.arg)
        except transient as exc:
            first: BaseException = exc
        return await aretry_after(first, partial(operation, io.arg), self.policy, transient,
                                  what=f"{self.stats.owner}.{op}",
                                  on_error=self.stats.count_error)

    def _async_behind(self) -> AsyncWriteBehind:
        if self._abehind is None:
            assert self.write_behind is not None
            self._abehind = AsyncWriteBehind(self._acomplete, self.write_behind)
        return self._abehind

    async def _acomplete(self, claims: Sequence[Claim]) -> list[bool]:
        return await adrive(complete_steps(self.rules, claims), self._aperform, _no_handler)

    async def aexecute(
        self, key: object, call: Callable[[Any], Awaitable[R]], *, group: str = "",
        fingerprint: str | None = None, fail_open: bool = False,
        store_result: bool = False, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    ) -> Executed[R]:
        """:meth:`LeaseChecker.execute` for an ``async def`` handler: ``await
        call(None)`` unless ``key`` is DONE or in progress; the same rules, outcomes
        and errors. A handler cancelled while it runs releases its claim, like one that
        raises."""
        self._check_open()
        # lease_steps in direct style (the async hot path; differential-tested against
        # adrive(lease_steps(...)))
        return await alease_call(self.rules, self._aperform, self.keys.build(key, group),
                                 fingerprint, checker_options(fail_open, store_result,
                                                              max_result_bytes,
                                                              self.result_key), call)

    async def aflush(self) -> None:
        """Write every completion queued by ``write_behind`` (fast mode)."""
        if self._abehind is not None:
            await self._abehind.flush()

    # -- batches of guarded calls: the store steps of AsyncBatchStore ------------------

    async def aclaim_stored(self, store_keys: Sequence[str],
                            fingerprints: Sequence[str | None]) -> list[Claim]:
        """:meth:`LeaseChecker.claim_stored`, awaited: rule 1 for many built keys in one
        ``claim_many`` round trip. Raises :class:`StoreUnavailable` (rule 6 is the
        caller's)."""
        if not store_keys:
            return []
        self._check_open()
        claims: list[Claim] = await adrive(claim_many_steps(self.rules, store_keys,
                                                            fingerprints),
                                           self._aperform, _no_handler)
        return claims

    async def acomplete_ran(self, claims: Sequence[Claim]) -> None:
        """:meth:`LeaseChecker.complete_ran`, awaited: rule 2 for many handlers that
        returned, one ``complete_many`` (or queued behind with ``write_behind``); a
        store that stays unreachable is logged, not raised."""
        if self.write_behind is not None:
            behind = self._async_behind()
            claims = [claim for claim in claims if not await behind.add(claim)]
        await self._awrite(complete_steps, claims, "completing")

    async def arelease_failed(self, claims: Sequence[Claim]) -> None:
        """:meth:`LeaseChecker.release_failed`, awaited: rule 3 for many handlers that
        raised, one ``release_many``; a store that stays unreachable is logged."""
        await self._awrite(release_steps, claims, "releasing")

    async def _awrite(self, steps: Callable[[LeaseRules, Sequence[Claim]], Steps[list[bool]]],
                      claims: Sequence[Claim], what: str) -> None:
        if not claims:
            return
        try:
            self._check_open()
            await adrive(steps(self.rules, claims), self._aperform, _no_handler)
        except StoreUnavailable as exc:
            log.error("%s %d idempotency key(s) failed (%s); their leases expire and the "
                      "messages may run again", what, len(claims), exc)


class AsyncLeaseChecker(AsyncDriver, _LeaseBase):
    """Base of the async lease checkers (:class:`AsyncRedisChecker`,
    :class:`AsyncSqlChecker`): ``aexecute`` and ``aclose``. With ``write_behind``
    (fast mode) completions are written by a task on the loop, within that many
    seconds, many per round trip."""

    def __init__(self, astore: AsyncStore, **options: Any) -> None:
        super().__init__(**options)
        self.astore = astore
        if self.write_behind is not None:
            self.rules.pending = self._async_behind().pending

    async def _aclose(self) -> None:
        """Release the store connections this checker created."""

    async def aclose(self) -> None:
        """Write queued completions, then release connections this checker created;
        afterwards every operation raises :class:`CheckerClosed`. Idempotent."""
        if self._closed:
            return
        if self._abehind is not None:
            await self._abehind.flush()
        if self._mark_closed():
            await self._aclose()

    async def __aenter__(self) -> Self:
        """``async with checker:`` - the block's end awaits :meth:`aclose`."""
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
