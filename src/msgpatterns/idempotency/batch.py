"""Batch-aware idempotency: the keys of many messages claimed in one store round trip
and completed in one, for a runtime that runs several messages of one ``@idempotent``
handler at once (the :class:`~msgpatterns.Consumer`).

The runtime asks :func:`guard_of` whether its handler is ``@idempotent`` (through the
attribute the decorator sets, never by name), then per batch:

1. :meth:`BatchGuard.prepare` - one ``claim_many`` round trip; one :class:`Entry` per
   message: run the handler (the undecorated function: no store call of its own), or
   settle without running it - a duplicate (DONE) as a success, a key held by a live
   owner with :class:`~msgpatterns.errors.InProgress`, a fingerprint conflict, a
   missing key, an unreachable store (rule 6) with their errors;
2. the runtime runs the handlers;
3. :meth:`BatchGuard.finish` - one ``complete_many`` round trip for the handlers that
   returned, one ``release_many`` for those that raised. The runtime acknowledges the
   messages only after it returned: DONE is written before the acks go out.

Every decision is one of the six rules, taken by the guard
(:mod:`msgpatterns.idempotency.guard`); data flows one way (the runtime calls down into this module,
nothing here calls back up). An entry is finished once: :meth:`BatchGuard.take` is
atomic, so a message settled on another thread (an explicit ``ack``, its ack deadline,
``stop()``) and its batch's :meth:`~BatchGuard.finish` never both write its claim.

Failure window (lease checkers): a crash after a handler's effect and before the
batch's ``complete_many`` leaves that batch's keys PROCESSING; each frees itself when
its lease (counted from the batch's claim) expires, and the redelivered messages run
again (at-least-once), exactly as for one message - the window is the batch's run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from msgpatterns.errors import ConfigurationError, StoreUnavailable
from msgpatterns.idempotency.base import NO_RESULT, LeaseChecker
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
    (kept with the DONE mark under ``store_result``)."""

    message: Message
    run: bool
    claim: Claim | None = None
    error: BaseException | None = None
    result: Any = NO_RESULT
    open: bool = False
    later: bool = False


class BatchGuard:
    """What ``@idempotent`` offers a runtime that runs many messages at once.

    ``handler`` is the undecorated function. Made by the decorator; find it with
    :func:`guard_of`."""

    def __init__(self, *, checker: Any, handler: Callable[..., Any],
                 wrapper: Callable[..., Any], group: str, identify: Identify,
                 on_duplicate: Callable[..., Any] | None, fail_open: bool,
                 store_result: bool, max_result_bytes: int) -> None:
        #: False for a checker without batch claims (TransactionalSqlChecker, a custom
        #: Checker): its handlers run one message at a time, through the decorator.
        self.batchable = isinstance(checker, LeaseChecker)
        self.checker: LeaseChecker = checker
        self.handler = handler
        self.wrapper = wrapper
        self.group = group
        self.store_result = store_result
        self._identify = identify
        self._on_duplicate = on_duplicate
        self._fail_open = fail_open
        self._max_result_bytes = max_result_bytes
        self._lock = threading.Lock()

    def prepare(self, messages: Sequence[Message]) -> list[Entry]:
        """One entry per message, in order, after ONE claim round trip for all of them
        (none when every key was found locally or could not be computed). Never raises
        for a message: its error is in its entry."""
        entries: list[Entry] = []
        keys: list[str] = []
        prints: list[str | None] = []
        asked: list[Entry] = []
        for message in messages:
            try:
                key, fingerprint = self._identify(message)
            except Exception as exc:  # MissingIdempotencyKey, MalformedMessage, ...
                entries.append(Entry(message, False, error=exc))
                continue
            entry = Entry(message, True)
            entries.append(entry)
            asked.append(entry)
            keys.append(key)
            prints.append(fingerprint)
        if not asked:
            return entries
        try:
            claims = self.checker.claim_stored(keys, prints)
        except StoreUnavailable as exc:
            self._unavailable(asked, keys, exc)
            return entries
        except Exception as exc:  # a closed checker, a store bug: fail, never skip dedup
            for entry in asked:
                entry.run, entry.error = False, exc
            return entries
        mine: set[str] = set()  # keys this batch claimed
        for entry, claim in zip(asked, claims, strict=True):
            if claim.token is not None:
                entry.claim, entry.open = claim, True
                mine.add(claim.key)
                continue
            entry.run = False
            if claim.status is Status.IN_PROGRESS and claim.key in mine:
                entry.later = True  # held by this batch: decided once it is finished
                continue
            try:  # rules 4 and 5 (and the fingerprint check), as one message has them
                skip_or_raise(claim, self.store_result)
                if self._on_duplicate is not None:
                    self._on_duplicate(entry.message)
            except Exception as exc:
                entry.error = exc
        return entries

    def _unavailable(self, entries: list[Entry], keys: list[str],
                     error: StoreUnavailable) -> None:
        """Rule 6 for each message: NeedRetry, or run without dedup if opted in."""
        delay = self.checker.policy.unavailable_delay
        for entry, key in zip(entries, keys, strict=True):
            refusal = refuse_unavailable(self.checker.stats, key, error,
                                         fail_open=self._fail_open, delay=delay)
            if refusal is not None:
                entry.run, entry.error = False, refusal

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
        done = [entry.claim for entry in self.take(returned) if entry.claim is not None]
        failed = [entry.claim for entry in self.take(raised) if entry.claim is not None]
        if done and self.store_result:
            results = {id(entry.claim): entry.result for entry in returned}
            done = [with_result(claim, results.get(id(claim)), self.checker.stats,
                                self._max_result_bytes) for claim in done]
        self.checker.complete_ran(done)
        self.checker.release_failed(failed)

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
