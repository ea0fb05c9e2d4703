"""Where the asyncio driver's deliveries report their outcome.

The asyncio twin of :mod:`.settling`. A delivery settled anywhere - the handler
returned or raised, an explicit ``message.ack`` (from any task or thread), the ack
deadline, a stop - reports ``(message, error)`` to :meth:`AsyncSettling.on_settled`.
The settlement (the settler's operations, awaited on the broker with
:func:`~msgpatterns.runtime.settler.run_async`) then frees the slot in the
:class:`~msgpatterns.runtime.async_flow.AsyncFlow`. Nothing here calls back into the
consumer: delivery -> settling -> settler -> broker -> the flow's slots.

Who awaits the settlement: the worker that ran the handler awaits its own outcome
itself (:meth:`finish` - no task, no extra hop through the loop); any other settlement
gets a task of its own (:meth:`spawn`), kept in :attr:`AsyncSettling.tasks` until it
ended; one from a foreign thread is moved onto the loop first.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

from msgpatterns._escape import escape_control
from msgpatterns.deadletter import DeadLetterStore
from msgpatterns.deadlines import DeadlineTracker
from msgpatterns.idempotency.batch import BatchGuard, Entry
from msgpatterns.message import Message
from msgpatterns.observability import stats as _obs
from msgpatterns.runtime.async_flow import AsyncFlow
from msgpatterns.runtime.rounds import expired
from msgpatterns.runtime.settler import Settled, Settler, run_async
from msgpatterns.runtime.stats import Reporter

__all__ = ["AsyncSettling"]


class AsyncSettling:
    """Carries out settlements for one asyncio consumer."""

    def __init__(self, *, broker: Any, settler: Settler, flow: AsyncFlow,
                 dead_letters: DeadLetterStore | None, reporter: Reporter,
                 log: logging.Logger) -> None:
        self.broker = broker
        self.settler = settler
        self.flow = flow
        self.dead_letters = dead_letters
        self.reporter = reporter
        self.log = log
        #: Settlements running in tasks of their own.
        self.tasks: set[asyncio.Task[Any]] = set()
        #: The ack deadlines of the current run (set at start).
        self.deadlines: DeadlineTracker[Message] | None = None
        #: A success is a plain ack: no key gate, no custom decide (set at start).
        self.plain_acks = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        # The settlement the worker running finish() awaits itself.
        self._inline: Message | None = None
        self._outcome: tuple[BaseException | None] | None = None

    def reset(self, loop: asyncio.AbstractEventLoop,
              deadlines: DeadlineTracker[Message] | None, plain_acks: bool) -> None:
        """A new run on ``loop`` (the calling thread's)."""
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self.deadlines = deadlines
        self.plain_acks = plain_acks

    # -- the delivery's sink ------------------------------------------------------------

    def on_settled(self, message: Message, error: BaseException | None) -> None:
        """A delivery was settled (once, on any thread): carry the settlement out on
        the loop - awaited by the worker inside :meth:`finish`, else in a new task."""
        if threading.get_ident() != self._loop_thread:
            self._from_thread(self.spawn, message, error)
        elif self._inline is message:
            self._outcome = (error,)
        else:
            self.spawn(message, error)

    def on_claimed_settled(self, guard: BatchGuard, entry: Entry, message: Message,
                           error: BaseException | None) -> None:
        """The sink of a batch-claimed delivery settled outside its run (an explicit
        ack, its deadline, a stop): its claim is finished first - completed on a
        success, released on a failure, except that its deadline or a stop leaves the
        claim of a handler still running to that run (:meth:`BatchGuard.asettled`) -
        then it is settled, in a task of its own."""
        claimed = partial(self._settle_claimed, guard, entry)
        if threading.get_ident() != self._loop_thread:
            self._from_thread(self._track, claimed, message, error)
        else:
            self._track(claimed, message, error)

    def _from_thread(self, then: Callable[..., object], *args: object) -> None:
        loop = self._loop
        assert loop is not None
        try:
            loop.call_soon_threadsafe(then, *args)
        except RuntimeError:  # the loop is closed: the stop handed it back already
            self.log.warning("%s: late settlement of %s after the loop closed",
                             self.settler.name, escape_control(getattr(args[-2], "id", None)))

    def finish(self, message: Message,
               error: BaseException | None) -> tuple[BaseException | None] | None:
        """The handler of ``message`` ended with ``error``: record it on the delivery.
        Returns the outcome the caller must now :meth:`settle` (awaiting it itself),
        or None when there is nothing to settle (settled already, or awaiting an
        explicit ack)."""
        self._inline, self._outcome = message, None
        try:
            message.delivery.finish(message, error)
            return self._outcome
        finally:
            self._inline = self._outcome = None

    def quick_ack(self, message: Message) -> bool:
        """The handler of ``message`` returned: when its success is a plain ack (auto
        ack, no key gate, no custom decide, no telemetry listener), settle the delivery
        quietly and return True - the caller then awaits :meth:`ack`. False: use
        :meth:`finish` (nothing changed)."""
        delivery = message.delivery
        return (self.plain_acks and delivery.auto_ack and _obs.listener is None
                and delivery.settle_quietly())

    async def ack(self, message: Message) -> None:
        """Carry out a success settled by :meth:`quick_ack`: the ack, the freed slot
        (a failed ack is settled another way)."""
        deadlines = self.deadlines
        if deadlines is not None:
            deadlines.untrack(message)
        try:
            await self.broker.ack(message)
        except Exception as failure:
            await self._ack_failed(message, failure)
            return
        self.flow.free_acked(message)

    def spawn(self, message: Message, error: BaseException | None) -> None:
        """Settle in a task of its own."""
        self._track(self.settle, message, error)

    def _track(self, settle: Callable[[Message, BaseException | None], Awaitable[None]],
               message: Message, error: BaseException | None) -> None:
        self._in_task(settle(message, error))

    def _in_task(self, work: Awaitable[None]) -> None:
        """Run ``work`` in a task of its own, kept until it ends (stop awaits them)."""
        task = asyncio.ensure_future(work)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def ack_all(self, messages: Sequence[Message]) -> None:
        """Settle successful deliveries (auto ack; their claims completed already):
        each acked and its slot freed here; where a settlement must be seen per
        message (a telemetry listener, ordered mode's key gate, a RetryPolicy that
        overrides decide) each goes through its delivery's sink instead."""
        if not self.plain_acks or _obs.listener is not None:
            for message in messages:
                message.delivery.finish(message, None)
            return
        for message in messages:
            if message.delivery.settle_quietly():
                await self.ack(message)

    # -- the settlement -----------------------------------------------------------------

    async def settle(self, message: Message, error: BaseException | None) -> None:
        """Carry out the settlement of ``message`` (awaiting its broker operations);
        whatever fails, the delivery is settled another way and its slot freed."""
        if error is None and self.plain_acks and _obs.listener is None:
            await self.ack(message)  # a success is an ack and a freed slot
            return
        deadlines = self.deadlines
        if deadlines is not None:
            deadlines.untrack(message)
        settled = Settled(["broker_errors"])
        try:
            settled = await run_async(self.settler.settle(message, error), self.broker,
                                      self.dead_letters)
        finally:
            self.reporter.settled(message, settled.counted, error)  # before the slot
            if self.flow.free(message, settled):
                self.spawn_hand_back([message])

    async def _settle_claimed(self, guard: BatchGuard, entry: Entry, message: Message,
                              error: BaseException | None) -> None:
        if entry.open:
            try:
                await guard.asettled(entry, error, expired=expired(error))
            except Exception:
                self.log.exception("%s: finishing the idempotency claim of %s failed",
                                   self.settler.name, escape_control(message.id),
                                   extra=self.settler.extra(message))
        await self.settle(message, error)

    async def _ack_failed(self, message: Message, failure: Exception) -> None:
        """The ack of a success raised: settle it another way, count, free the slot."""
        settled = Settled(["broker_errors"])
        try:
            settled = await run_async(self.settler.ack_failed(message, failure),
                                      self.broker, self.dead_letters)
        finally:
            self.reporter.settled(message, settled.counted, None)
            self.flow.free(message, settled)

    async def hand_back(self, messages: Sequence[Message], *, fetched: bool = True) -> None:
        """Nack ``messages`` unprocessed (a fetch that returned after the stop began,
        or a retry copy made after it)."""
        stats = self.flow.stats
        if fetched:
            stats.fetched += len(messages)
        errors = await run_async(self.settler.hand_back(messages), self.broker, None)
        stats.released += len(messages) - errors
        stats.broker_errors += errors

    def spawn_hand_back(self, messages: Sequence[Message]) -> None:
        """:meth:`hand_back` retry copies, in a task of its own."""
        self._in_task(self.hand_back(messages, fetched=False))
