"""Batch-aware idempotency: the keys of many messages claimed in one store round trip,
for a runtime that runs several messages of one ``@idempotent`` handler at once (the
:class:`~msgpatterns.Consumer`, the :class:`~msgpatterns.aio.AsyncConsumer`).

The runtime asks :func:`guard_of` whether its handler is ``@idempotent`` (through the
attribute the decorator sets, never by name), then per batch:

1. :meth:`BatchGuard.prepare` - one ``claim_many`` round trip; one :class:`Entry` per
   message: run the handler (the undecorated function: no store call of its own), or
   settle without running it - a duplicate (DONE) as a success, a key held by a live
   owner with :class:`~msgpatterns.errors.InProgress`, a fingerprint conflict, a
   missing key, an unreachable store (rule 6) with their errors;
2. the runtime runs the handlers, each between :meth:`BatchGuard.begin` and the end of
   its run;
3. :meth:`BatchGuard.finish` as each handler ends - rule 2 (``complete_many``) for
   those that returned, rule 3 (``release_many``) for those that raised; handlers that
   end together may share one round trip, but none waits for another. The runtime
   acknowledges a message only after its completion returned: DONE is written before
   the ack.

Every decision is one of the six rules, taken by the guard
(:mod:`msgpatterns.idempotency.guard`); data flows one way (the runtime calls down into
this module, nothing here calls back up). An entry is finished once: :meth:`BatchGuard.take`
is atomic, so a message settled on another thread (an explicit ``ack``, its ack
deadline, ``stop()``) and its run never both write its claim. Such a settlement
(:meth:`BatchGuard.settled`) completes the claim on a success and releases it on a
failure - except that the ack deadline or a stop never takes the claim from a handler
that is running: it stays with that run (completed if it returns, released if it
raises), so no other delivery of the key runs while it still runs, and a handler that
returned has its claim completed whatever happened to its message meanwhile.

Failure window (lease checkers): a crash after a handler's effect and before its
``complete_many`` returned leaves its key PROCESSING; it frees itself when its lease
(counted from the batch's claim) expires, and the redelivered message runs again
(at-least-once), exactly as for one message - the window is the message's own run and
its completion, never its batch's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from msgpatterns.errors import ConfigurationError, StoreUnavailable
from msgpatterns.idempotency.base import NO_RESULT
from msgpatterns.idempotency.batch_store import AsyncBatchStore, BatchStore, StoreTerms
from msgpatterns.idempotency.guard import refuse_unavailable, skip_or_raise, with_result
from msgpatterns.idempotency.records import Claim, Status
from msgpatterns.message import Message

__all__ = ["GUARD_ATTRIBUTE", "BatchGuard", "Entry", "guard_of"]

#: The attribute ``@idempotent`` sets on the handler it returns.
GUARD_ATTRIBUTE = "__msgpatterns_idempotent__"

#: Computes (stored key, fingerprint) from the handler's arguments, or raises.
Identify = Callable[..., tuple[str, "str | None"]]


@dataclass(eq=False, slots=True)
class Entry:
    """One message's idempotency state within a batch.

    ``run``: call the handler. Otherwise settle the message without it: as a success
    (a duplicate) when ``error`` is None, else failed with ``error`` - unless ``later``:
    its key is held by an earlier message of this very batch, so prepare it again once
    the batch is finished (it is then a duplicate, or runs if the earlier one failed).
    ``claim``: the
    owned claim to complete or release (None when there is nothing to write: not run,
    or run without dedup by ``fail_open``). ``result``: what the handler returned
    (kept with the DONE mark under ``store_result``). ``open``: the claim is not
    finished yet. ``running``: its handler is running (between :meth:`BatchGuard.begin`
    and the end of its run)."""

    message: Message
    run: bool
    claim: Claim | None = None
    error: BaseException | None = None
    result: Any = NO_RESULT
    open: bool = False
    later: bool = False
    running: bool = False


class BatchGuard:
    """What ``@idempotent`` offers a runtime that runs many messages at once.

    ``handler`` is the undecorated function. Made by the decorator; find it with
    :func:`guard_of`."""

    def __init__(self, *, checker: Any, handler: Callable[..., Any],
                 wrapper: Callable[..., Any], group: str, identify: Identify,
                 on_duplicate: Callable[..., Any] | None, fail_open: bool,
                 store_result: bool, max_result_bytes: int) -> None:
        #: The checker's batch store steps, sync (:class:`BatchStore`: a LeaseChecker,
        #: MemoryChecker also for ``async def`` handlers) or awaited
        #: (:class:`AsyncBatchStore`: an AsyncLeaseChecker). None: no batch claims.
        self._store = checker if isinstance(checker, BatchStore) else None
        self._astore = None if self._store is not None or not isinstance(
            checker, AsyncBatchStore) else checker
        #: False for a checker without batch claims (TransactionalSqlChecker, a custom
        #: Checker): its handlers run one message at a time, through the decorator.
        self.batchable = self._store is not None or self._astore is not None
        #: The checker (its lease, policy and counters: :class:`StoreTerms`).
        self.checker: StoreTerms = checker
        self.handler = handler
        self.wrapper = wrapper
        self.group = group
        self.store_result = store_result
        self._identify = identify
        self._on_duplicate = on_duplicate
        self._fail_open = fail_open
        self._max_result_bytes = max_result_bytes
        self._lock = threading.Lock()

    @property
    def _result_key(self) -> bytes | None:
        """The checker's ``result_key`` now (it may be set after decorating)."""
        return self.checker.result_key

    def _sync(self) -> BatchStore:
        store = self._store
        if store is None:
            raise TypeError(f"{type(self.checker).__name__} claims in batches only when "
                            "awaited (aprepare, afinish, asettled)")
        return store

    def prepare(self, messages: Sequence[Message]) -> list[Entry]:
        """One entry per message, in order, after ONE claim round trip for all of them
        (none when every key was found locally or could not be computed). Never raises
        for a message: its error is in its entry."""
        plan = self._plan(messages)
        try:
            claims = self._sync().claim_stored(plan.keys, plan.prints) if plan.keys else []
        except Exception as exc:
            return self._refused(plan, exc)
        return self._decide(plan, claims)

    async def aprepare(self, messages: Sequence[Message]) -> list[Entry]:
        """:meth:`prepare` for an ``async def`` handler: the one claim round trip is
        awaited on the async checker (a MemoryChecker answers in process)."""
        plan = self._plan(messages)
        try:
            claims = await self._aclaim(plan.keys, plan.prints)
        except Exception as exc:
            return self._refused(plan, exc)
        return self._decide(plan, claims)

    def _plan(self, messages: Sequence[Message]) -> _Plan:
        """Each message's key and fingerprint (an error in its entry when it has none):
        what the claim round trip asks for."""
        plan = _Plan([], [], [], [])
        for message in messages:
            try:
                key, fingerprint = self._identify(message)
            except Exception as exc:  # MissingIdempotencyKey, MalformedMessage, ...
                plan.entries.append(Entry(message, False, error=exc))
                continue
            entry = Entry(message, True)
            plan.entries.append(entry)
            plan.asked.append(entry)
            plan.keys.append(key)
            plan.prints.append(fingerprint)
        return plan

    def _refused(self, plan: _Plan, error: Exception) -> list[Entry]:
        """The claim round trip raised: rule 6 for an unreachable store; any other
        failure (a closed checker, a store bug) fails the messages, never skips dedup."""
        if isinstance(error, StoreUnavailable):
            self._unavailable(plan.asked, plan.keys, error)
        else:
            for entry in plan.asked:
                entry.run, entry.error = False, error
        return plan.entries

    def _decide(self, plan: _Plan, claims: Sequence[Claim]) -> list[Entry]:
        """Each message's entry from its claim: run it (claimed), prepare it again
        after this batch (held by an earlier message of the batch), or settle it
        without running (rules 4 and 5: a duplicate, a key in progress, a conflict)."""
        mine: set[str] = set()  # keys this batch claimed
        for entry, claim in zip(plan.asked, claims, strict=True):
            if claim.token is not None:
                entry.claim, entry.open = claim, True
                mine.add(claim.key)
                continue
            entry.run = False
            if claim.status is Status.IN_PROGRESS and claim.key in mine:
                entry.later = True  # held by this batch: decided once it is finished
                continue
            try:  # rules 4 and 5 (and the fingerprint check), as one message has them
                skip_or_raise(claim, self.store_result, self._result_key)
                if self._on_duplicate is not None:
                    self._on_duplicate(entry.message)
            except Exception as exc:
                entry.error = exc
        return plan.entries

    def _unavailable(self, entries: list[Entry], keys: list[str],
                     error: StoreUnavailable) -> None:
        """Rule 6 for each message: NeedRetry, or run without dedup if opted in."""
        delay = self.checker.policy.unavailable_delay
        for entry, key in zip(entries, keys, strict=True):
            refusal = refuse_unavailable(self.checker.stats, key, error,
                                         fail_open=self._fail_open, delay=delay)
            if refusal is not None:
                entry.run, entry.error = False, refusal

    def begin(self, entry: Entry) -> bool:
        """``entry``'s handler is about to run: True, and from now on its ack deadline
        or a stop no longer finishes the claim (its run does); False when the claim was
        finished already (its message was settled before it ran: do not run it). An
        entry that runs without a claim (``fail_open`` with the store unreachable) has
        nothing to finish: True (the caller still skips a message settled already)."""
        with self._lock:
            if entry.claim is None and entry.run:
                return True
            if not entry.open:
                return False
            entry.running = True
            return True

    def end(self, entry: Entry) -> bool:
        """``entry``'s handler returned and its message awaits an explicit ack: from
        now on its settlement finishes the claim. True when that settlement came during
        the run: finish the claim now (:meth:`settled` with the delivery's error)."""
        with self._lock:
            entry.running = False
        return entry.message.delivery.settled

    def settled(self, entry: Entry, error: BaseException | None, *,
                expired: bool = False) -> None:
        """``entry``'s message was settled outside its run: a success (an explicit ack)
        completes the claim; a failure (an explicit ``ack(error)``) releases it. An
        ``expired`` settlement (its ack deadline, a stop: not the handler's word)
        releases it only when its handler is not running - a running handler's claim
        stays with that run, which finishes it when it ends. Once per entry; never
        raises for a store failure (logged: see the module's failure window)."""
        if self._take_settled(entry, error, expired):
            done, failed = self._claims_of(*_split(entry, error))
            if done:
                self._sync().complete_ran(done)
            if failed:
                self._sync().release_failed(failed)

    async def asettled(self, entry: Entry, error: BaseException | None, *,
                       expired: bool = False) -> None:
        """:meth:`settled` for an ``async def`` handler, the round trip awaited."""
        if self._take_settled(entry, error, expired):
            done, failed = self._claims_of(*_split(entry, error))
            await self._acomplete(done)
            await self._arelease(failed)

    def _take_settled(self, entry: Entry, error: BaseException | None,
                      expired: bool) -> bool:
        with self._lock:
            if not entry.open or (expired and entry.running):
                return False
            entry.open = False
            return True

    def take(self, entries: Sequence[Entry]) -> list[Entry]:
        """The entries whose claim is still open, now closed (atomic: each entry is
        taken once, whichever thread asks first)."""
        with self._lock:
            taken = [entry for entry in entries if entry.open]
            for entry in taken:
                entry.open = False
        return taken

    def finish(self, returned: Sequence[Entry], raised: Sequence[Entry]) -> None:
        """Rule 2 for the entries whose handler returned (one ``complete_many``, with
        their results under ``store_result``), then rule 3 for those whose handler
        raised (one ``release_many``). Entries finished already are skipped. Never
        raises for a store failure (it is logged: see the module's failure window)."""
        done, failed = self._to_finish(returned, raised)
        store = self._sync()
        store.complete_ran(done)
        store.release_failed(failed)

    async def afinish(self, returned: Sequence[Entry], raised: Sequence[Entry]) -> None:
        """:meth:`finish` for an ``async def`` handler, the round trips awaited."""
        done, failed = self._to_finish(returned, raised)
        await self._acomplete(done)
        await self._arelease(failed)

    # -- the awaited store steps (a sync BatchStore, MemoryChecker, answers in process) --

    async def _aclaim(self, keys: list[str], prints: list[str | None]) -> list[Claim]:
        if not keys:
            return []
        if self._astore is None:
            return self._sync().claim_stored(keys, prints)
        return await self._astore.aclaim_stored(keys, prints)

    async def _acomplete(self, claims: list[Claim]) -> None:
        if self._astore is None:
            self._sync().complete_ran(claims)
        else:
            await self._astore.acomplete_ran(claims)

    async def _arelease(self, claims: list[Claim]) -> None:
        if self._astore is None:
            self._sync().release_failed(claims)
        else:
            await self._astore.arelease_failed(claims)

    def _to_finish(self, returned: Sequence[Entry],
                   raised: Sequence[Entry]) -> tuple[list[Claim], list[Claim]]:
        """The claims to complete (with their results) and to release, taken."""
        return self._claims_of(self.take(returned), self.take(raised))

    def _claims_of(self, returned: Sequence[Entry],
                   raised: Sequence[Entry]) -> tuple[list[Claim], list[Claim]]:
        """The claims of taken entries: to complete (with their results), to release."""
        done = [entry.claim for entry in returned if entry.claim is not None]
        failed = [entry.claim for entry in raised if entry.claim is not None]
        if done and self.store_result:
            results = {id(entry.claim): entry.result for entry in returned}
            done = [with_result(claim, results.get(id(claim)), self.checker.stats,
                                self._max_result_bytes, self._result_key) for claim in done]
        return done, failed

    def __repr__(self) -> str:
        return f"BatchGuard({self.checker!r}, group={self.group!r})"


def guard_of(handler: object, *, batch: bool = False) -> BatchGuard | None:
    """The batch guard of an ``@idempotent`` handler, or None: not decorated, decorated
    and then wrapped again (the outer wrapper must run), or on a checker that claims
    inside the handler's own transaction (TransactionalSqlChecker: each message keeps
    its own transaction - claimed, written and committed together - as without
    batching).

    ``batch``: the handler takes a list of messages (a batch handler). Refused there
    with ``ConfigurationError``: another decorator around ``@idempotent`` (it would
    receive the list), TransactionalSqlChecker or a checker that is not a
    :class:`~msgpatterns.idempotency.LeaseChecker` (no batch claims), and
    ``store_result`` (a batch handler returns one value, not one per message)."""
    guard = getattr(handler, GUARD_ATTRIBUTE, None)
    if not isinstance(guard, BatchGuard):
        return None
    problem = None
    if guard.wrapper is not handler:
        problem = ("@idempotent is wrapped by another decorator, which would receive the "
                   "list; put @idempotent outermost")
    elif not guard.batchable:
        problem = (f"{type(guard.checker).__name__} claims each key inside that message's "
                   "own transaction; use a per-message handler (one transaction per "
                   "message) or a SqlChecker / RedisChecker (claims per batch)")
    elif batch and guard.store_result:
        problem = ("store_result keeps one result per message, and a batch handler "
                   "returns one value for the whole batch")
    if problem is None:
        return guard
    if batch:
        raise ConfigurationError(f"batch handler {guard.group}: {problem}")
    return None


def _split(entry: Entry, error: BaseException | None) -> tuple[list[Entry], list[Entry]]:
    """(returned, raised) for one entry settled with ``error``."""
    return ([entry], []) if error is None else ([], [entry])


@dataclass(slots=True)
class _Plan:
    """One batch's entries, and the claim round trip to make for those it asks about
    (``asked``, with their store ``keys`` and fingerprints ``prints``)."""

    entries: list[Entry]
    asked: list[Entry]
    keys: list[str]
    prints: list[str | None]
