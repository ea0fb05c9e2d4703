"""The asyncio driver of the claim rounds (:mod:`msgpatterns.runtime.rounds`).

It awaits the operations the rounds ask for on the consumer's loop: the claim round
trip on the worker that took the batch, the claimed messages pushed to the front of
the ready queue for the other workers, the handler awaited by whichever worker takes
its message, and the completions written by the worker whose handler returned when
no completion was being written (the handlers that return meanwhile share its next
round trip). Every decision is the rounds' own.

Cancellation: ``stop()`` cancels the workers that are not settling. A worker is
marked settling (in the consumer's ``finishing`` set) while it awaits any operation
but a handler run - so a claim, a completion or an ack under way is never cut short;
a handler cancelled by the stop releases its claim and ends the worker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from msgpatterns._escape import escape_control
from msgpatterns.idempotency.batch import BatchGuard, Entry
from msgpatterns.message import Message
from msgpatterns.observability import stats as _obs
from msgpatterns.runtime.async_flow import AsyncFlow
from msgpatterns.runtime.async_settling import AsyncSettling
from msgpatterns.runtime.lifecycle import State
from msgpatterns.runtime.rounds import (
    STOPPED,
    AckAll,
    Bind,
    Claimed,
    ClaimRounds,
    Close,
    Fail,
    Pause,
    Prepare,
    Run,
    Settle,
    SettleUnrun,
    Share,
    StartScope,
    Steps,
    WakeWriter,
    Write,
    adrive,
)

__all__ = ["AsyncRounds", "settling_work"]


def settling_work(finishing: set[asyncio.Task[Any]],
                  perform: Callable[[Any], Awaitable[Any]]) -> Callable[[Any], Awaitable[Any]]:
    """``perform``, with the task awaiting it marked settling (in ``finishing``, the
    consumer's set of workers a stop lets finish) meanwhile."""

    async def settling(op: Any) -> Any:
        task = asyncio.current_task()
        assert task is not None
        mine = task not in finishing
        if mine:
            finishing.add(task)
        try:
            return await perform(op)
        finally:
            if mine:
                finishing.discard(task)

    return settling


class AsyncRounds:
    """Performs the claim rounds of one asyncio consumer.

    Args:
        guard: the async ``@idempotent`` handler's batch guard.
        flow: the consumer's flow (its ready queue takes the claimed messages).
        settling: where settlements go.
        finishing: the consumer's workers now settling (``stop()`` lets them finish).
        settle_unrun: settles a message whose handler does not run.
        log: the consumer's logger.
        start_scope: starts a telemetry scope for a run (the consumer's; a CONSUMER
            span per claimed run, as the thread driver opens).
    """

    def __init__(self, guard: BatchGuard, *, flow: AsyncFlow, settling: AsyncSettling,
                 finishing: set[asyncio.Task[Any]],
                 settle_unrun: Callable[[Message, BaseException | None], Awaitable[None]],
                 log: logging.Logger, start_scope: StartScope | None = None) -> None:
        self.guard = guard
        #: The decisions (the writer is the worker whose handler returned: it runs the
        #: first handler of a round it starts, as any worker does).
        self.core = ClaimRounds(guard, writer_runs_handlers=True)
        self.flow = flow
        self.settling = settling
        self.finishing = finishing
        self.log = log
        self._settle_unrun = settle_unrun
        self._start_scope = start_scope
        self._name = settling.settler.name
        #: What awaits each operation of the rounds (returns its answer). Every one but
        #: a handler run is settling work: ``stop()`` does not cancel it. (A batch
        #: handler's run adds its call: :class:`~.async_batches.AsyncBatches`.)
        self.ops: dict[type[Any], Callable[[Any], Awaitable[Any]]] = {
            Run: self._run, WakeWriter: self._wake,
            **{kind: settling_work(finishing, perform) for kind, perform in (
                (Write, self._write), (AckAll, self._ack_all), (Prepare, self._prepare),
                (Bind, self._bind), (Share, self._share), (SettleUnrun, self._unrun),
                (Fail, self._fail), (Close, self._close), (Settle, self._settle),
                (Pause, self._pause))},
        }

    async def _drive(self, steps: Steps[Any]) -> Any:
        return await adrive(steps, self.ops)

    # -- what the consumer asks -------------------------------------------------------

    async def item(self, item: Message | Claimed, take: Callable[[Message], Awaitable[
            list[Message]]]) -> None:
        """A worker's item: a claimed message of a round (run it), or a ready message
        (``take`` makes it and the ready messages after it a new round: one claim round
        trip). Re-raises ``CancelledError`` when the stop cancelled a handler run."""
        try:
            if isinstance(item, Claimed):  # ClaimRounds.run, its steps one by one
                step = self.core.begin(item)
                if isinstance(step, Run):
                    after = self.core.ran(item, await self._run(step))
                    outcome = None if after is None else await self._drive(after)
                else:
                    outcome = await self._drive(step)
            else:
                outcome = await self._drive(self.core.round(await take(item)))
        except asyncio.CancelledError:
            raise
        except BaseException:  # the worker survives whatever happens
            self.log.exception("%s: running a batch failed", self._name)
            return
        if outcome is STOPPED:
            raise asyncio.CancelledError

    # -- the operations ---------------------------------------------------------------

    async def _run(self, op: Run) -> BaseException | None:
        entry = op.entry
        listener, start_scope = _obs.listener, self._start_scope
        scope = None if listener is None or start_scope is None \
            else start_scope(listener, entry.message)
        error: BaseException | None = None
        try:
            entry.result = await self.guard.handler(entry.message)
        except asyncio.CancelledError as exc:
            if self.flow.state is State.STOPPED:
                if scope is not None:
                    _obs.report(scope.close)
                return STOPPED  # type: ignore[no-any-return]  # stop() cancelled it
            error = exc  # the handler's own cancellation fails the message
        except BaseException as exc:  # SystemExit & co fail the message, not the loop
            error = exc
        if scope is not None:
            _obs.report(scope.handler_returned, error)
            _obs.report(scope.close)
        return error

    async def _wake(self, op: WakeWriter) -> Any:
        """This worker is the writer: write the completions now."""
        return await self._drive(self.core.write_returned())

    async def _write(self, op: Write) -> None:
        try:
            await self.guard.afinish(op.returned, op.raised)
        except Exception:  # a closed checker...: the effects happened; settle anyway
            self.log.exception("%s: writing %d idempotency claim(s) failed", self._name,
                               len(op.returned) + len(op.raised))

    async def _ack_all(self, op: AckAll) -> None:
        try:
            await self.settling.ack_all(op.messages)
        except Exception:  # the worker goes on writing what is queued
            self.log.exception("%s: acking %d messages failed", self._name,
                               len(op.messages))

    async def _prepare(self, op: Prepare) -> list[Entry]:
        return await self.guard.aprepare(op.messages)

    async def _bind(self, op: Bind) -> None:
        for entry in op.entries:
            entry.message.delivery.bind(partial(self.claimed_settled, entry))

    def claimed_settled(self, entry: Entry, message: Message,
                         error: BaseException | None) -> None:
        """The sink of a claimed delivery settled outside its run (see
        :meth:`ClaimRounds.settled`): carried out in a task of its own. A batch
        handler's claimed deliveries are bound to it too."""
        self.settling.settle_with(partial(self._settled, entry), message, error)

    async def _settled(self, entry: Entry, message: Message,
                       error: BaseException | None) -> None:
        await self._drive(self.core.settled(entry, message, error))

    async def _share(self, op: Share) -> None:
        self.flow.push_claimed(op.claimed)

    async def _unrun(self, op: SettleUnrun) -> None:
        await self._settle_unrun(op.message, op.error)

    async def _fail(self, op: Fail) -> None:
        message = op.message
        message.delivery.bind(self.settling.on_settled)  # its claim is finished
        outcome = self.settling.finish(message, op.error)
        if outcome is not None:
            await self.settling.settle(message, outcome[0])

    async def _close(self, op: Close) -> None:
        try:
            await self.guard.asettled(op.entry, op.error, expired=op.expired)
        except Exception:
            message = op.entry.message
            self.log.exception("%s: finishing the idempotency claim of %s failed",
                               self._name, escape_control(message.id),
                               extra=self.settling.settler.extra(message))

    async def _settle(self, op: Settle) -> None:
        await self.settling.settle(op.message, op.error)

    async def _pause(self, op: Pause) -> None:
        await asyncio.sleep(0)  # the handlers returning in this turn join in
