"""The asyncio driver's batch runs: the batch claims of an async ``@idempotent``
handler and batch handlers (``AsyncConsumer(..., batch=True)``).

The asyncio twin of :mod:`.thread_batches`, on the same sans-I/O cores: a worker that
takes a ready message takes the ready messages after it too (up to ``fetch_batch``) -
for one ``await handler(messages)`` (:func:`msgpatterns.runtime.batches.run_batch`:
every message then settled on its own, the claims of an ``@idempotent`` handler
finished first), or for a new claim round (:mod:`msgpatterns.runtime.rounds`). Only
the waiting differs: the worker task awaits each operation itself, marked settling
(``stop()`` lets it end) while it awaits anything but the handler.

A stop that cancels a batch handler (its messages were handed back already) releases
the claims the call held, so no key stays PROCESSING until its lease runs out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from msgpatterns.deadlines import DeadlineTracker
from msgpatterns.errors import MalformedMessage
from msgpatterns.message import Message
from msgpatterns.runtime.async_flow import AsyncFlow
from msgpatterns.runtime.async_rounds import AsyncRounds, settling_work
from msgpatterns.runtime.async_settling import AsyncSettling
from msgpatterns.runtime.batches import run_batch
from msgpatterns.runtime.lifecycle import State
from msgpatterns.runtime.rounds import (
    STOPPED,
    AckAll,
    CallBatch,
    Claimed,
    Fail,
    StartScope,
    adrive,
)

__all__ = ["AsyncBatches"]


class AsyncBatches:
    """Runs the batches of one asyncio consumer.

    Args:
        handler: the handler (the ``async def handler(messages)`` when ``batch``).
        batch: it is a batch handler.
        rounds: the claim rounds when it is ``@idempotent`` on a lease checker.
        settling: where settlements are carried out.
        flow: the consumer's flow (its ready queue; its state tells a stop's
            cancellation apart).
        finishing: the consumer's set of worker tasks that a stop must not cancel now.
        decode: decodes a message's body; the error that settles it instead (None:
            no decoder).
        settle_unrun: settles a message whose handler does not run.
        start_scope: opens a message's telemetry scope.
        fetch_batch: the largest batch; ``log``: the consumer's logger; ``name``: its
            name.
    """

    def __init__(self, *, handler: Callable[[Any], Any], batch: bool,
                 rounds: AsyncRounds | None, settling: AsyncSettling, flow: AsyncFlow,
                 finishing: set[asyncio.Task[Any]],
                 decode: Callable[[Message], Awaitable[MalformedMessage | None]] | None,
                 settle_unrun: Callable[[Message, BaseException | None], Awaitable[None]],
                 start_scope: StartScope, fetch_batch: int, log: logging.Logger,
                 name: str) -> None:
        self.handler = handler
        self.batch = batch
        self.rounds = rounds
        self.settling = settling
        self.flow = flow
        self.decode = decode
        self.settle_unrun = settle_unrun
        self.start_scope = start_scope
        self.fetch_batch = fetch_batch
        self.log = log
        self.name = name
        #: The ack deadlines of the current run (set at start).
        self.deadlines: DeadlineTracker[Message] | None = None
        #: What awaits each operation of a batch handler's run: all but the call are
        #: settling work (``stop()`` does not cancel them).
        self.ops: dict[type[Any], Callable[[Any], Awaitable[Any]]] = {
            Fail: settling_work(finishing, self._fail),
            AckAll: settling_work(finishing, self._ack_all),
            **({} if rounds is None else rounds.ops), CallBatch: self._call,
        }

    async def item(self, item: Message | Claimed) -> None:
        """A worker's item: a claimed message of a round under way (run it), or a
        ready message - it and the ready messages after it make a batch. Re-raises
        ``CancelledError`` when the stop cancelled a handler run."""
        if self.batch:  # no claimed items in the queue: only messages
            assert isinstance(item, Message)
            await self.run_batch(self.take_ready(item))
            return
        assert self.rounds is not None
        await self.rounds.item(item, self.take_round)

    async def run_batch(self, messages: list[Message]) -> None:
        """One batch of ready messages for the batch handler."""
        try:
            outcome = await adrive(
                run_batch(None if self.rounds is None else self.rounds.core,
                          await self.intake(messages), start_scope=self.start_scope,
                          log=self.log, name=self.name), self.ops)
        except asyncio.CancelledError:
            raise
        except BaseException:  # the worker survives whatever happens
            self.log.exception("%s: running a batch of %d messages failed", self.name,
                               len(messages))
            return
        if outcome is STOPPED:  # the stop cancelled the handler: the worker ends
            raise asyncio.CancelledError

    async def take_round(self, first: Message) -> list[Message]:
        """A new claim round: ``first`` and the ready messages after it, the deadlines
        started and the bodies decoded (see :meth:`take_ready`, :meth:`intake`)."""
        return await self.intake(self.take_ready(first))

    def take_ready(self, first: Message) -> list[Message]:
        """``first`` and the ready messages after it (not claimed ones), up to
        ``fetch_batch``."""
        chunk = [first]
        ready = self.flow.ready
        while len(chunk) < self.fetch_batch and ready and not isinstance(ready[0], Claimed):
            chunk.append(ready.popleft())  # type: ignore[arg-type]  # not Claimed
        return chunk

    async def intake(self, messages: list[Message]) -> list[Message]:
        """Start the deadlines and decode; the messages left to run (not handed back,
        decodable; a malformed one is settled here)."""
        live = [message for message in messages if not message.acked]
        if self.deadlines is not None:
            for message in live:
                self.deadlines.track(message)
        if self.decode is None:
            return live
        decoded: list[Message] = []
        for message in live:
            malformed = await self.decode(message)
            if malformed is None:
                decoded.append(message)
            else:
                await self.settle_unrun(message, malformed)
        return decoded

    # -- the operations of a batch handler's run ------------------------------------

    async def _call(self, op: CallBatch) -> Any:
        handler = self.handler if self.rounds is None else self.rounds.guard.handler
        try:
            await handler(op.messages)
        except asyncio.CancelledError as exc:
            if self.flow.state is State.STOPPED:  # stop() cancelled it: handed back
                return STOPPED
            return exc  # the handler's own cancellation fails the batch
        except BaseException as exc:  # SystemExit & co fail the batch, not the worker
            return exc
        return None

    async def _fail(self, op: Fail) -> None:
        settling = self.settling
        outcome = settling.finish(op.message, op.error)
        if outcome is not None:
            await settling.settle(op.message, outcome[0])

    async def _ack_all(self, op: AckAll) -> None:
        await self.settling.ack_all(op.messages)
