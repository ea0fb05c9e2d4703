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

The hot path - a success is a plain ack and a freed slot, when no key gate, no
overridden ``RetryPolicy.decide`` and no telemetry listener must see it - is chosen
once, by :meth:`AsyncSettling.choose` when the consumer starts (and again when the
listener changes), never tested per message.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from msgpatterns._escape import escape_control
from msgpatterns.deadletter import DeadLetterStore
from msgpatterns.deadlines import DeadlineTracker
from msgpatterns.message import Message
from msgpatterns.observability import stats as _obs
from msgpatterns.runtime.async_flow import AsyncFlow
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
        #: Whether a handler's success may be settled quietly (see :meth:`choose`).
        self.quick_ack: Callable[[Message], bool] = _never
        #: Settle successful deliveries together (see :meth:`choose`).
        self.ack_all: Callable[[Sequence[Message]], Awaitable[None]] = self._finish_each
        self._succeeded: Callable[[Message], Awaitable[None]] = self._settle_success
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        # The settlement the worker running finish() awaits itself.
        self._inline: Message | None = None
        self._outcome: tuple[BaseException | None] | None = None

    def reset(self, loop: asyncio.AbstractEventLoop,
              deadlines: DeadlineTracker[Message] | None) -> None:
        """A new run on ``loop`` (the calling thread's)."""
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self.deadlines = deadlines

    def choose(self, *, plain_acks: bool) -> bool:
        """Pick the hot path or its plain twin (at start, and when the telemetry
        listener changes): with ``plain_acks`` (no key gate, no overridden decide) and
        no listener, a handler's success under auto ack is settled quietly by its
        worker (:attr:`quick_ack`, then :meth:`ack`) and successes are acked together
        (:attr:`ack_all`); otherwise every success goes through the settler and is
        reported. Returns True for the hot path."""
        fast = plain_acks and _obs.listener is None
        self.quick_ack = _settle_quietly if fast else _never
        self.ack_all = self._ack_all_quietly if fast else self._finish_each
        self._succeeded = self.ack if fast else self._settle_success
        return fast

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

    def settle_with(self, settle: Callable[[Message, BaseException | None], Awaitable[None]],
                    message: Message, error: BaseException | None) -> None:
        """Carry out ``settle(message, error)`` in a task of its own (a sink settled
        outside its run: an explicit ack, its deadline, a stop), moved onto the loop
        first when it comes from another thread."""
        if threading.get_ident() != self._loop_thread:
            self._from_thread(self._track, settle, message, error)
        else:
            self._track(settle, message, error)

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

    async def ack(self, message: Message) -> None:
        """Carry out a success settled by :attr:`quick_ack`: the ack, the freed slot
        (a failed ack is settled another way)."""
        deadlines = self.deadlines
        if deadlines is not None:
            deadlines.untrack(message)
        try:
            await self.broker.ack(message)
        except Exception as failure:
            await self._ack_failed(message, failure)
            return
        if _obs.listener is not None:
            self.reporter.settled(message, ["acked"], None)  # before the slot
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

    async def _finish_each(self, messages: Sequence[Message]) -> None:
        """Successes whose settlement must be seen per message (a telemetry listener,
        ordered mode's key gate, a RetryPolicy that overrides decide): each through its
        delivery's sink."""
        for message in messages:
            message.delivery.finish(message, None)

    async def _ack_all_quietly(self, messages: Sequence[Message]) -> None:
        """The hot path of many successes (their claims completed already): each under
        auto ack settled quietly, acked and its slot freed here; one awaiting its
        handler's explicit ack is left alone."""
        for message in messages:  # (one whose handler acks it itself is left alone)
            delivery = message.delivery
            if delivery.auto_ack and delivery.settle_quietly():
                await self.ack(message)

    # -- the settlement -----------------------------------------------------------------

    async def settle(self, message: Message, error: BaseException | None) -> None:
        """Carry out the settlement of ``message`` (awaiting its broker operations);
        whatever fails, the delivery is settled another way and its slot freed."""
        if error is None:
            await self._succeeded(message)
        else:
            await self._settle(message, error)

    async def _settle_success(self, message: Message) -> None:
        await self._settle(message, None)

    async def _settle(self, message: Message, error: BaseException | None) -> None:
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
        self.reporter.count({"fetched": len(messages) if fetched else 0,
                             "released": len(messages) - errors, "broker_errors": errors})

    def spawn_hand_back(self, messages: Sequence[Message]) -> None:
        """:meth:`hand_back` retry copies, in a task of its own."""
        self._in_task(self.hand_back(messages, fetched=False))


def _never(message: Message) -> bool:
    """The plain twin of the hot path: a success is never settled quietly."""
    return False


def _settle_quietly(message: Message) -> bool:
    """The hot path: the handler of ``message`` returned under auto ack - settle the
    delivery quietly and return True (the caller then awaits
    :meth:`AsyncSettling.ack`); False, and nothing changed, otherwise."""
    delivery = message.delivery
    return delivery.auto_ack and delivery.settle_quietly()
