"""The asyncio driver's batch handlers: ``AsyncConsumer(..., batch=True)``.

The asyncio twin of the thread driver's batch runs, on the same rules
(:mod:`.batches`): one ``await handler(messages)`` per batch of ready messages (up to
``fetch_batch``), then every message settled on its own - successes acked (their
claims completed first when the handler is ``@idempotent``), failures (the batch's
error, or their :class:`~msgpatterns.errors.PartialFailure` entry) through the retry
policy one by one, explicit acks left to the handler. Only the waiting differs: the
worker task that ran the handler awaits the claims and the settlements itself.

A stop that cancels the handler (its messages were handed back already) releases the
claims the call held, so no key stays PROCESSING until its lease runs out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

from msgpatterns.idempotency.batch import BatchGuard, Entry
from msgpatterns.message import Message
from msgpatterns.observability import stats as _obs
from msgpatterns.observability.stats import DeliveryScope, Listener
from msgpatterns.runtime.async_flow import AsyncFlow
from msgpatterns.runtime.async_settling import AsyncSettling
from msgpatterns.runtime.batches import begin_all, judge_batch, sort_prepared
from msgpatterns.runtime.lifecycle import State

__all__ = ["AsyncBatches"]

Task = asyncio.Task[Any]
R = TypeVar("R")


class AsyncBatches:
    """Runs the batch handler of one asyncio consumer.

    Args:
        handler: the ``async def handler(messages)``.
        guard: its batch claims when it is ``@idempotent`` on a lease checker.
        settling: where settlements are carried out.
        flow: the consumer's flow (its state tells a stop's cancellation apart).
        finishing: the consumer's set of worker tasks that a stop must not cancel now.
        intake: starts the deadlines and decodes; returns the messages left to run.
        settle_unrun: settles a message whose handler does not run.
        start_scope: opens a message's telemetry scope.
        log: the consumer's logger; ``name``: its name.
    """

    def __init__(self, *, handler: Callable[[list[Message]], Any],
                 guard: BatchGuard | None, settling: AsyncSettling, flow: AsyncFlow,
                 finishing: set[Task],
                 claimed_settled: Callable[[Entry, Message, BaseException | None], None]
                 | None,
                 intake: Callable[[list[Message]], Awaitable[list[Message]]],
                 settle_unrun: Callable[[Message, BaseException | None], Awaitable[None]],
                 start_scope: Callable[[Listener, Message], DeliveryScope | None],
                 log: logging.Logger, name: str) -> None:
        self.handler = handler
        self.guard = guard
        #: The sink of a claimed delivery settled outside the call (its claim finished
        #: first): the claim rounds' (:meth:`AsyncRounds.claimed_settled`).
        self.claimed_settled = claimed_settled
        self.settling = settling
        self.flow = flow
        self.finishing = finishing
        self.intake = intake
        self.settle_unrun = settle_unrun
        self.start_scope = start_scope
        self.log = log
        self.name = name

    async def run(self, messages: list[Message], me: Task) -> None:
        """One batch of ready messages, run by the worker task ``me``."""
        try:
            await self._run(await self.intake(messages), me)
        except asyncio.CancelledError:
            raise
        except BaseException:  # the worker survives whatever happens
            self.log.exception("%s: running a batch of %d messages failed", self.name,
                               len(messages))

    async def _run(self, live: list[Message], me: Task) -> None:
        guard = self.guard
        entries: dict[Message, Entry] = {}
        later: list[Message] = []
        if guard is not None and live:
            live, later, entries = await self._claim(guard, live, me)
        if not live:
            if later:
                await self._run([m for m in later if not m.acked], me)
            return
        listener = _obs.listener
        scopes = None if listener is None else [self.start_scope(listener, m) for m in live]
        handler = self.handler if guard is None else guard.handler
        error: BaseException | None = None
        try:
            await handler(list(live))
        except asyncio.CancelledError as exc:
            if self.flow.state is State.STOPPED:  # stop() cancelled it: handed back
                _close(scopes)
                if guard is not None and entries:  # its keys are free again
                    await self._finish(guard, [], list(entries.values()), me)
                raise
            error = exc  # the handler's own cancellation fails the batch
        except BaseException as exc:  # SystemExit & co fail the batch, not the worker
            error = exc
        if error is None and guard is None and scopes is None:
            # The common case: every message returned (ack_all leaves alone those the
            # handler settled or acks itself).
            await self._finishing(self.settling.ack_all(live), me)
            return
        try:
            await self._settle(live, error, entries, scopes, me)
        finally:
            _close(scopes)
        if later:  # repeats of keys this batch held: duplicates now (or run)
            await self._run([m for m in later if not m.acked], me)

    async def _claim(self, guard: BatchGuard, live: list[Message],
                     me: Task) -> tuple[list[Message], list[Message], dict[Message, Entry]]:
        """One claim round trip for ``live``: settle those whose handler does not run;
        the messages the handler receives, those to prepare again after this batch, and
        the claimed entries by message."""
        prepared = sort_prepared(await self._finishing(guard.aprepare(live), me))
        for entry in prepared.unrun:
            await self.settle_unrun(entry.message, entry.error)
        for entry in prepared.runs:
            if entry.claim is not None:  # whoever settles it finishes its claim first
                assert self.claimed_settled is not None  # given with a guard
                entry.message.delivery.bind(partial(self.claimed_settled, entry))
        run, release = begin_all(guard, prepared.runs)
        if release:  # settled before the call: their keys are free again
            await self._finish(guard, [], release, me)
        return run, prepared.later, {entry.message: entry for entry in prepared.runs}

    async def _settle(self, live: list[Message], error: BaseException | None,
                      entries: dict[Message, Entry], scopes: list[DeliveryScope | None] | None,
                      me: Task) -> None:
        """Settle each message of the call on ``live`` that ended with ``error``."""
        outcome = judge_batch(live, error, log=self.log, name=self.name)
        if scopes is not None:
            for index, scope in enumerate(scopes):
                if scope is not None:
                    _obs.report(scope.handler_returned, outcome.error_of(index))
        settling = self.settling
        self.finishing.add(me)  # claims and settlements under way are not cancelled
        try:
            guard = self.guard
            if guard is not None and entries:
                done, failed, explicit = outcome.claims(entries)
                await self._finish(guard, done, failed, me)
                for entry in explicit:  # their claims are finished when acked ...
                    if guard.end(entry):  # ... or now, when that came during the call
                        returned = entry.message.ack_error is None
                        await self._finish(guard, [entry] if returned else [],
                                           [] if returned else [entry], me)
                for entry in failed:  # nothing left to finish: settled right here
                    entry.message.delivery.bind(settling.on_settled)
            for message, failed_with in outcome.raised:
                settled = settling.finish(message, failed_with)
                if settled is not None:
                    await settling.settle(message, settled[0])
            await settling.ack_all(outcome.returned)
        finally:
            self.finishing.discard(me)

    async def _finish(self, guard: BatchGuard, returned: list[Entry], raised: list[Entry],
                      me: Task) -> None:
        """Complete the claims of ``returned`` and release those of ``raised`` (if still
        open); a store failure is logged (the effects happened: settle anyway)."""
        try:
            await self._finishing(guard.afinish(returned, raised), me)
        except Exception:
            self.log.exception("%s: finishing %d idempotency claims failed", self.name,
                               len(returned) + len(raised))

    async def _finishing(self, work: Awaitable[R], me: Task) -> R:
        """Await ``work`` with ``me`` marked as finishing: a stop lets it end."""
        if me in self.finishing:  # marked by the caller already
            return await work
        self.finishing.add(me)
        try:
            return await work
        finally:
            self.finishing.discard(me)


def _close(scopes: list[DeliveryScope | None] | None) -> None:
    if scopes is not None:
        for scope in reversed(scopes):
            if scope is not None:
                _obs.report(scope.close)
