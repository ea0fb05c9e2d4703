"""AsyncConsumer: ``async def`` handlers on an event loop, the same guarantees as
:class:`~msgpatterns.Consumer`.

It is a second driver of the same parts (:mod:`msgpatterns.runtime`), not a second
runtime: every outcome goes through the same settler (:meth:`RetryPolicy.decide` ->
broker operations -> counts, awaited here with
:func:`~msgpatterns.runtime.settler.run_async`); the slots, the retry scheduler and its
clock, the idle driver and ordered mode's key gate are the thread driver's own.
Only the waiting differs: ``max_in_flight`` long-lived worker coroutines pulling from
a ready queue (:mod:`msgpatterns.runtime.async_flow`) and ``asyncio`` timers instead
of threads and a wheel. Data flows one way: fetch -> worker runs the handler ->
the delivery's sink (:mod:`msgpatterns.runtime.async_settling`) -> settler -> broker
-> the freed slot; no delivery, retry timer or deadline calls back into the consumer.

Guarantees:

* Flow control: never more than ``max_in_flight`` messages fetched and not yet settled
  (running, awaiting an explicit ack, waiting for a retry, or parked behind their key).
* Every delivery is settled exactly once, by the first of: the handler returning
  (auto ack), an explicit ``message.ack`` (from any task or thread), the handler
  raising, the ack deadline (:class:`~msgpatterns.errors.AckTimeout`), or the consumer
  stopping (handed back). Local retries wait with ``asyncio.sleep``; redeliveries go
  through the broker's ``nack(delay)``; the last allowed failure is dead-lettered.
* A settlement that fails is settled another way (a fallback dead letter, or a nack),
  never left hanging.
* Ordered mode: a key's messages run one at a time in delivery order; a message being
  retried holds its key (its later messages wait; other keys go on).
* Batch claims: an async ``@idempotent`` handler on a lease checker has the keys of a
  batch of ready messages claimed in one store round trip; each key is completed as
  soon as its own handler returned (those returning meanwhile share one round trip),
  DONE written before its ack (:class:`~msgpatterns.idempotency.batch.BatchGuard` and
  :mod:`msgpatterns.runtime.rounds`, shared with the thread driver). Neither the ack
  deadline nor a stop takes the claim of a handler still running; duplicates and keys
  in progress are settled without running it.
* ``await stop(timeout)``: no fetch starts; in-flight work may finish until
  ``timeout``; then every message still unsettled is handed back to the broker and the
  handler tasks still running are cancelled and awaited. When it returns no handler of
  this consumer runs again and every task it started has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import signal
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any, cast

from msgpatterns._callables import is_async_callable, require_async_callable
from msgpatterns.aio.base import AsyncBroker
from msgpatterns.deadletter import DeadLetterStore
from msgpatterns.deadlines import DeadlineTracker
from msgpatterns.errors import (
    BrokerClosed,
    ConfigurationError,
    MalformedMessage,
    describe,
    seconds,
)
from msgpatterns.idempotency.batch import BatchGuard, Entry, guard_of
from msgpatterns.message import Message
from msgpatterns.retry import RetryPolicy
from msgpatterns.runtime.async_flow import AsyncFlow
from msgpatterns.runtime.async_settling import AsyncSettling
from msgpatterns.runtime.clock import LoopTimer, VirtualClock
from msgpatterns.runtime.driver import DriverBase, ack_deadline_passed
from msgpatterns.runtime.gate import KeyGate
from msgpatterns.runtime.idle import jump_or_none
from msgpatterns.runtime.lifecycle import Released, State
from msgpatterns.runtime.rounds import Claimed, Completions, Round
from msgpatterns.runtime.stats import ConsumerStats, Reporter

__all__ = ["AsyncConsumer", "AsyncHandler"]

log = logging.getLogger("msgpatterns.aio.consumer")

AsyncHandler = Callable[[Message], Any]

#: The AsyncConsumer whose handler task this is (stop() there only requests the stop).
_own_task: contextvars.ContextVar[AsyncConsumer | None] = contextvars.ContextVar(
    "msgpatterns_async_consumer", default=None)

def _no_count(counts: object, message: object) -> None:
    """The asyncio driver reports no counts to a telemetry listener (yet)."""


class AsyncConsumer(DriverBase):
    """Runs ``await handler(message)`` for every message of ``topics`` in ``group``.

    Args:
        broker: an :class:`~msgpatterns.aio.base.AsyncBroker`.
        handler: an ``async def handler(message)``; return to ack, raise to fail. A
            sync callable is refused with ``TypeError`` (use :class:`~msgpatterns.Consumer`).
        topics: topics (streams, queues) to consume.
        group: consumer group.
        max_in_flight: most messages held at once, and so most handlers running.
        retry: the :class:`RetryPolicy` (default ``RetryPolicy()``).
        ordered: process each ``message.key`` serially in delivery order.
        ack_timeout: seconds a delivery may stay unsettled before it is failed with
            :class:`~msgpatterns.errors.AckTimeout` (0: no deadline).
        decoder: turns ``message.raw_body`` into ``message.body`` before the handler
            (a plain function, or an ``async def``); an error there is a
            :class:`~msgpatterns.errors.MalformedMessage`, dead-lettered at once.
        dead_letters: a store for dead letters instead of the broker's own (its
            ``put`` runs in a worker thread).
        poll_timeout: longest a fetch waits (bounds ``stop`` latency); positive.
        shutdown_timeout: how long ``run()`` lets in-flight work finish on SIGTERM.
        fetch_batch: most messages one fetch asks for.
        name: for logs.
    """

    broker: AsyncBroker

    def __init__(
        self,
        broker: AsyncBroker,
        handler: AsyncHandler,
        *,
        topics: Sequence[str],
        group: str,
        max_in_flight: int = 100,
        retry: RetryPolicy | None = None,
        ordered: bool = False,
        ack_timeout: float | timedelta = 900.0,
        decoder: Callable[[Any], Any] | None = None,
        dead_letters: DeadLetterStore | None = None,
        poll_timeout: float | timedelta = 0.25,
        shutdown_timeout: float | timedelta | None = 30.0,
        fetch_batch: int = 64,
        name: str | None = None,
    ) -> None:
        if not isinstance(broker, AsyncBroker) or not inspect.iscoroutinefunction(
                getattr(broker, "fetch", None)):
            raise ConfigurationError(
                "AsyncConsumer broker must implement the AsyncBroker protocol (async "
                "fetch, ack, nack, dead_letter, publish, close; now), got "
                f"{type(broker).__name__} (a sync broker goes with msgpatterns.Consumer)"
            )
        require_async_callable(handler, what="handler", where="AsyncConsumer",
                               alternative="msgpatterns.Consumer")
        if decoder is not None and not callable(decoder):
            raise ConfigurationError(f"AsyncConsumer decoder must be callable, got {decoder!r}")
        self._configure(
            "AsyncConsumer", broker=broker, handler=handler, topics=topics, group=group,
            retry=retry, ordered=ordered, max_in_flight=max_in_flight,
            ack_timeout=ack_timeout, decoder=decoder, dead_letters=dead_letters,
            poll_timeout=poll_timeout, shutdown_timeout=shutdown_timeout,
            fetch_batch=fetch_batch, name=name, default_name=f"msgpatterns-async-{group}",
            counts={}, log=log)
        self.handler = handler
        self._async_decoder = decoder is not None and is_async_callable(decoder)
        #: The batch claims of an async @idempotent handler on a lease checker (None:
        #: plain, or one transaction per message).
        self._guard: BatchGuard | None = guard_of(handler)
        #: A RetryPolicy whose decide() is overridden sees every success too.
        self._plain_decide = type(self.retry).decide is RetryPolicy.decide
        #: The claims of batch-claimed handlers that returned, being completed.
        self._completions = Completions()
        #: Fewest free slots for which a worker fetches itself (see _top_up).
        self._top_up_min = max(1, min(fetch_batch, max_in_flight) // 4)

        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: LoopTimer | None = None  # ack deadlines and retry timers
        self._deadlines: DeadlineTracker[Message] | None = None  # ack deadlines
        self._workers: list[asyncio.Task[None]] = []
        self._finishing: set[asyncio.Task[Any]] = set()  # workers now settling
        self._fetcher: asyncio.Task[None] | None = None
        self._stop_requested: asyncio.Event | None = None
        self._stopping: asyncio.Lock | None = None
        self._until_idle = False
        #: The slots, the ready queue, the retry scheduler and the wake-ups.
        self._flow = AsyncFlow(self.stats, VirtualClock(None, broker.now))
        #: Where deliveries report their outcome (settler -> broker -> freed slot).
        self._settling = AsyncSettling(
            broker=broker, settler=self._settler, flow=self._flow,
            dead_letters=dead_letters, reporter=Reporter(self), log=log)
        self._settler.rebind = self._settling.on_settled

    @property
    def _state(self) -> State:
        """The lifecycle state (kept by the flow)."""
        return self._flow.state

    @_state.setter
    def _state(self, state: State) -> None:
        self._flow.state = state

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Start fetching on the running loop and return."""
        if self._state is State.RUNNING:
            return
        if self._state is State.STOPPING:
            raise RuntimeError("the consumer is stopping")
        loop = self._loop = asyncio.get_running_loop()
        self._stop_requested = asyncio.Event()
        self._stopping = asyncio.Lock()
        self._timer = LoopTimer(loop)
        gate = KeyGate() if self.ordered else None
        self._flow.reset(loop, self._retry_clock(self._timer, self._until_idle), gate)
        self._deadlines = (
            DeadlineTracker(self._timer, self.ack_timeout, partial(
                ack_deadline_passed, ack_timeout=self.ack_timeout,
                handler_name=self.handler_name, stats=self.stats, count=_no_count,
                log=log, settler=self._settler))
            if self.ack_timeout > 0 else None)
        self._settling.reset(loop, self._deadlines,
                             plain_acks=gate is None and self._plain_decide)
        self._state = State.RUNNING
        # One long-lived worker per slot: never more handlers run than messages held.
        self._workers = [asyncio.create_task(self._work(), name=f"{self.name}-worker-{i}")
                         for i in range(self.max_in_flight)]
        self._fetcher = asyncio.create_task(self._fetch_loop(), name=f"{self.name}-fetch")
        self._fetcher.add_done_callback(self._fetcher_ended)

    def _fetcher_ended(self, task: asyncio.Task[None]) -> None:
        """A fetch loop that died of a bug stops the consumer (run() returns, what is
        in flight is handed back) instead of leaving it silently idle."""
        if task.cancelled() or task.exception() is None:
            return
        log.error("%s: the fetch loop failed; stopping", self.name,
                  exc_info=task.exception())
        self._request_stop()

    async def stop(self, timeout: float | timedelta | None = None) -> bool:
        """Stop fetching, let in-flight work finish for up to ``timeout`` seconds, then
        hand every message still unsettled back to the broker.

        Guarantees, when it returns: no handler of this consumer runs again (handler
        tasks still running at the timeout are cancelled and awaited; their messages
        were handed back); every message fetched - including what a fetch in progress
        returns afterwards - is settled or handed back; every task the consumer started
        has ended. The broker may be closed right after.

        Awaited from one of this consumer's handlers it cannot wait for itself: it
        requests the stop and returns False at once.

        Returns True when all in-flight work finished within the timeout.
        """
        limit = seconds(timeout)
        if _own_task.get() is self:
            self._request_stop()
            return False
        if self._stopping is None:  # never started
            self._state = State.STOPPED
            return True
        async with self._stopping:
            return await self._stop(limit)

    async def _stop(self, limit: float | None) -> bool:
        if self._state in (State.NEW, State.STOPPED):
            self._state = State.STOPPED
            return True
        flow = self._flow
        self._state = State.STOPPING
        flow.notify()
        fetcher = self._fetcher
        if fetcher is not None:
            await asyncio.wait([fetcher])  # bounded by poll_timeout; hands back its fetch
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._drained(), limit)
        leftovers = list(flow.slots.held)
        flow.scheduler.clear()
        for message in leftovers:
            message.delivery.expire(message, Released("consumer stopped"))
        self._state = State.STOPPED
        for task in self._workers:
            if task not in self._finishing:  # a settlement in progress is let finish
                task.cancel()
        flow.wake_all()
        pending = self._settling.tasks
        while pending or self._workers:
            await asyncio.wait([*self._workers, *pending])
            self._workers = [task for task in self._workers if not task.done()]
        if self._timer is not None:
            self._timer.stop()
        flow.scheduler.clear()
        assert self._stop_requested is not None
        self._stop_requested.set()
        return not leftovers

    async def _drained(self) -> None:
        while self._flow.slots:
            await self._flow.wait_change()

    def _request_stop(self) -> None:
        """Ask for a stop without waiting (from a handler, or a signal)."""
        if self._state is State.RUNNING:
            self._state = State.STOPPING
            self._flow.notify()
        if self._stop_requested is not None:
            self._stop_requested.set()

    async def run(self) -> None:
        """Consume until SIGTERM, SIGINT or :meth:`stop`; then shut down gracefully
        (in-flight work gets ``shutdown_timeout``)."""
        loop = asyncio.get_running_loop()
        installed: list[signal.Signals] = []
        await self.start()
        try:
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    loop.add_signal_handler(sig, self._on_signal, sig)
                    installed.append(sig)
                except (NotImplementedError, RuntimeError, ValueError):
                    pass  # not the main thread, or no signals on this loop
            assert self._stop_requested is not None
            await self._stop_requested.wait()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
            if self._state is not State.STOPPED:
                await self.stop(self.shutdown_timeout)

    async def run_until_idle(self, timeout: float | timedelta | None = None) -> ConsumerStats:
        """Process until nothing is deliverable, in flight or waiting for a retry.

        On a broker with virtual time (the async fake) the clock jumps to the next due
        delivery or held retry whenever nothing can run, instead of sleeping. Raises
        ``TimeoutError`` if not idle within ``timeout`` seconds of wall time (the
        consumer is then stopped; unsettled messages go back to the broker).
        """
        limit = seconds(timeout)
        self._until_idle = True
        await self.start()
        assert self._stop_requested is not None
        try:
            await asyncio.wait_for(self._stop_requested.wait(), limit)
        except TimeoutError:
            self._until_idle = False
            await self.stop(0)
            raise TimeoutError(f"{self.name} not idle after {limit}s: {self.stats}") from None
        self._until_idle = False
        await self.stop(self.shutdown_timeout)
        return self.stats

    async def __aenter__(self) -> AsyncConsumer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop(self.shutdown_timeout)

    @property
    def in_flight(self) -> int:
        """Messages fetched and not yet settled."""
        return len(self._flow.slots)

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("%s: signal %s, shutting down", self.name, sig.name)
        if self._stop_requested is not None:
            self._stop_requested.set()

    # -- fetching -------------------------------------------------------------------

    async def _fetch_loop(self) -> None:
        """Fetch while slots are free (the workers take what may run), and (until
        idle) move virtual time when nothing can; exits when the consumer stops."""
        flow = self._flow
        slots = flow.slots
        while self._state is State.RUNNING:
            free = self.max_in_flight - len(slots)
            if free <= 0:
                # Full: only a settlement, or a held retry coming due, frees a slot.
                if not (self._until_idle and slots.nothing_active()
                        and self._jump(can_fetch=False)):
                    await flow.wait_change(self.poll_timeout)
                continue
            if flow.fetching:  # a worker is topping up (see _top_up)
                await flow.wait_change(self.poll_timeout)
                continue
            until_idle = self._until_idle
            generation = slots.settled
            flow.fetching = True
            try:
                messages = await self._fetch(min(free, self.fetch_batch),
                                             0.0 if until_idle else None)
            finally:
                flow.fetching = False
            if self._state is not State.RUNNING:
                await self._settling.hand_back(messages)
                return
            if messages:
                self._admit(messages)
                continue
            if not until_idle:
                continue
            if not slots.nothing_active():
                if slots.settled == generation:
                    await flow.wait_change(self.poll_timeout)
            elif not self._jump(can_fetch=True):
                if slots:  # retries due later in real time
                    await flow.wait_change(self.poll_timeout)
                else:
                    self._request_stop()
                    return

    def _admit(self, messages: list[Message], *, taker: bool = False) -> None:
        sink = self._settling.on_settled
        for message in messages:
            message.delivery.bind(sink)
        self._flow.admit(messages, taker=taker)

    def _may_top_up(self) -> bool:
        """Running, and enough slots free for a worker's own fetch."""
        return (self._flow.state is State.RUNNING
                and self.max_in_flight - len(self._flow.slots) >= self._top_up_min)

    async def _top_up(self) -> None:
        """A worker found nothing ready: when enough slots are free and no fetch is
        running, fetch without waiting (``timeout=0``) right here - the messages are
        then taken without waking the fetch loop and idle workers first. A fetch that
        returns after the stop began is handed back."""
        flow = self._flow
        if flow.fetching or not self._may_top_up():
            return
        flow.fetching = True
        try:
            messages = await self._fetch(
                min(self.max_in_flight - len(flow.slots), self.fetch_batch), 0.0)
        finally:
            flow.fetching = False
            flow.notify()
        if self._state is not State.RUNNING:
            await self._settling.hand_back(messages)
        elif messages:
            self._admit(messages, taker=True)

    async def _fetch(self, count: int, timeout: float | None) -> list[Message]:
        try:
            return await self.broker.fetch(
                self.topics, self.group, max_messages=count,
                timeout=self.poll_timeout if timeout is None else timeout)
        except BrokerClosed:
            if self._state is State.RUNNING:
                log.error("%s: the broker was closed while consuming; stopping", self.name)
                self._request_stop()
            return []
        except Exception:
            self.stats.broker_errors += 1
            log.exception("%s: fetch failed; retrying", self.name)
            await asyncio.sleep(min(self.poll_timeout, 1.0))
            return []

    def _jump(self, *, can_fetch: bool) -> bool:
        """Nothing active: move virtual time to the next moment something can run
        (:func:`msgpatterns.runtime.idle.jump`) and start the retries now due. True
        when progress became possible."""
        flow = self._flow
        moved = jump_or_none(self.broker, self.topics, self.group, flow.scheduler,
                             can_fetch=can_fetch, stats=self.stats, count=self._count,
                             log=log, name=self.name)
        if moved is None:
            return False
        fetchable, due = moved
        for message in due:
            flow.push(message)
        if due:
            flow.notify()
        return bool(due) or fetchable

    # -- the workers ------------------------------------------------------------------

    async def _work(self) -> None:
        """One worker: run the ready messages one after another until the run stops;
        the settlement of each handler's own outcome is awaited here, not in a task."""
        _own_task.set(self)
        me = asyncio.current_task()
        assert me is not None
        flow, settling, finishing = self._flow, self._settling, self._finishing
        ready = flow.ready
        handler = self.handler if self.decoder is None else self._decode_and_call
        deadlines, guard = self._deadlines, self._guard
        while True:
            if not ready and not flow.fetching and self._may_top_up():
                finishing.add(me)  # a fetch is not cancelled: what it brings is handed back
                try:
                    await self._top_up()
                finally:
                    finishing.discard(me)
            item = ready.popleft() if ready else await flow.next()
            if item is None or self._state is State.STOPPED:
                return
            if guard is not None:
                await self._batched(guard, item, me)
                continue
            message = cast(Message, item)
            if message.acked:
                continue  # handed back by stop() before it could run
            if deadlines is not None:
                deadlines.track(message)
            error: BaseException | None = None
            try:
                await handler(message)
            except asyncio.CancelledError as exc:
                if flow.state is State.STOPPED:
                    raise  # stop() cancelled it; its message was handed back
                error = exc  # the handler's own cancellation fails the message
            except BaseException as exc:  # SystemExit & co fail the message, not the loop
                error = exc
            if error is None and settling.quick_ack(message):
                # The hot path: a success settled here, without the delivery's sink.
                finishing.add(me)
                try:
                    await settling.ack(message)
                finally:
                    finishing.discard(me)
                continue
            outcome = settling.finish(message, error)
            if outcome is not None:
                finishing.add(me)
                try:
                    await settling.settle(message, outcome[0])
                finally:
                    finishing.discard(me)

    async def _decode_and_call(self, message: Message) -> None:
        malformed = await self._decode(message)
        if malformed is not None:
            raise malformed
        await self.handler(message)

    async def _decode(self, message: Message) -> MalformedMessage | None:
        """Decode ``message.body`` (the decoder may be an ``async def``); the error
        that settles it instead when the body cannot be decoded."""
        decoder = self.decoder
        assert decoder is not None
        try:
            body = decoder(message.raw_body)
            message.body = await body if self._async_decoder else body
        except Exception as exc:
            malformed = MalformedMessage(f"cannot decode body: {describe(exc)}")
            malformed.__cause__ = exc
            return malformed
        return None

    # -- batch claims of an async @idempotent handler ---------------------------------

    async def _batched(self, guard: BatchGuard, item: Message | Claimed,
                       me: asyncio.Task[Any]) -> None:
        """A worker's item when the handler's keys are claimed per batch: a claimed
        message of a round (run it), or a ready message (it and the ready messages
        after it make a new round: one claim round trip)."""
        try:
            if isinstance(item, Claimed):
                await self._run_claimed(item.guard, item.batch, item.entry, me)
            else:
                await self._claim_round(guard, await self._intake(self._take_ready(item)),
                                        me)
        except asyncio.CancelledError:
            raise
        except BaseException:  # the worker survives whatever happens
            log.exception("%s: running a batch failed", self.name)

    def _take_ready(self, first: Message) -> list[Message]:
        """``first`` and the ready messages after it (not claimed ones), up to
        ``fetch_batch``."""
        chunk = [first]
        ready = self._flow.ready
        while len(chunk) < self.fetch_batch and ready and not isinstance(ready[0], Claimed):
            chunk.append(cast(Message, ready.popleft()))
        return chunk

    async def _intake(self, messages: list[Message]) -> list[Message]:
        """Start the deadlines and decode; the messages left to run (not handed back,
        decodable; a malformed one is settled here)."""
        live = [message for message in messages if not message.acked]
        if self._deadlines is not None:
            for message in live:
                self._deadlines.track(message)
        if self.decoder is None:
            return live
        decoded: list[Message] = []
        for message in live:
            malformed = await self._decode(message)
            if malformed is None:
                decoded.append(message)
            else:
                await self._settle_unrun(message, malformed)
        return decoded

    async def _settle_unrun(self, message: Message, error: BaseException | None) -> None:
        """Settle a message whose handler does not run (a duplicate: success; a key in
        progress, a missing key, a malformed body: ``error``)."""
        outcome = self._settling.finish(message, error)
        if outcome is not None:
            await self._settling.settle(message, outcome[0])

    async def _claim_round(self, guard: BatchGuard, live: list[Message],
                           me: asyncio.Task[Any]) -> None:
        """One claim round trip for ``live``; settle those whose handler does not run,
        share the claimed ones out to the workers (this one runs the first). A claimed
        message completes or releases its claim before it is settled, whoever settles
        it (:meth:`AsyncSettling.on_claimed_settled`)."""
        if not live:
            return
        self._finishing.add(me)  # a claim in progress is not cancelled by stop()
        try:
            entries = await guard.aprepare(live)
        finally:
            self._finishing.discard(me)
        runs: list[Entry] = []
        later: list[Message] = []
        for entry in entries:
            if entry.later:
                later.append(entry.message)
            elif not entry.run:
                await self._settle_unrun(entry.message, entry.error)
            else:
                if entry.claim is not None:
                    entry.message.delivery.bind(
                        partial(self._settling.on_claimed_settled, guard, entry))
                runs.append(entry)
        if not runs:
            return
        batch = Round(len(runs), later, None)
        if len(runs) > 1:
            self._flow.push_claimed([Claimed(guard, batch, entry) for entry in runs[1:]])
        await self._run_claimed(guard, batch, runs[0], me)

    async def _run_claimed(self, guard: BatchGuard, batch: Round, entry: Entry,
                           me: asyncio.Task[Any]) -> None:
        """Run one claimed message's handler and finish its claim as it ends: released
        if it raised (or was cancelled by stop()), completed (with the claims of the
        handlers that returned with it) if it returned - never held for the rest of its
        round."""
        message = entry.message
        if not guard.begin(entry):  # settled before it ran: its claim was released then
            await self._round_ended(guard, batch, me)
            return
        if message.acked:  # handed back or expired before it ran: free its key
            await self._finish_claim(guard, entry, me, returned=False)
            await self._round_ended(guard, batch, me)
            return
        error: BaseException | None = None
        try:
            entry.result = await guard.handler(message)
        except asyncio.CancelledError as exc:
            if self._flow.state is State.STOPPED:
                # stop() cancelled it (its message was handed back): its key is free
                await self._finish_claim(guard, entry, me, returned=False)
                raise
            error = exc
        except BaseException as exc:  # SystemExit & co fail the message, not the loop
            error = exc
        if error is None and message.auto_ack:
            if self._completions.add(Claimed(guard, batch, entry)):
                await self._complete_returned(me)
            return  # its round is told once its claim is written
        if error is None:  # awaiting its explicit ack: its claim is finished then
            if guard.end(entry):  # ... or now, when that came during the run
                await self._finish_claim(guard, entry, me,
                                         returned=message.ack_error is None)
        else:
            await self._finish_claim(guard, entry, me, returned=False)
            message.delivery.bind(self._settling.on_settled)  # nothing left to finish
            outcome = self._settling.finish(message, error)
            if outcome is not None:
                self._finishing.add(me)
                try:
                    await self._settling.settle(message, outcome[0])
                finally:
                    self._finishing.discard(me)
        await self._round_ended(guard, batch, me)

    async def _finish_claim(self, guard: BatchGuard, entry: Entry, me: asyncio.Task[Any],
                            *, returned: bool) -> None:
        """Complete (``returned``) or release one message's claim (if still open); not
        cancelled by stop() once begun."""
        self._finishing.add(me)
        try:
            if returned:
                await guard.afinish((entry,), ())
            else:
                await guard.afinish((), (entry,))
        except Exception:  # a closed checker...: settle anyway
            log.exception("%s: finishing the idempotency claim of %s failed", self.name,
                          entry.message.id, extra=self._settler.extra(entry.message))
        finally:
            self._finishing.discard(me)

    async def _complete_returned(self, me: asyncio.Task[Any]) -> None:
        """The writer of :class:`~msgpatterns.runtime.rounds.Completions`: complete the
        claims of the handlers that returned (one round trip for all queued: those that
        returned in this turn of the loop, or during the last round trip), then ack
        their messages (DONE before ack); again until none is queued. Then the rounds
        all of whose claims are finished prepare the messages they held back."""
        ended: list[Claimed] = []
        self._finishing.add(me)  # a completion under way is not cancelled by stop()
        try:
            await asyncio.sleep(0)  # the handlers returning in this turn join in
            while claimed := self._completions.take():
                try:
                    await claimed[0].guard.afinish([c.entry for c in claimed], ())
                except Exception:  # a closed checker...: the effects happened; ack anyway
                    log.exception("%s: completing %d idempotency claims failed",
                                  self.name, len(claimed))
                try:
                    await self._settling.ack_all([c.entry.message for c in claimed])
                except Exception:  # the worker goes on writing what is queued
                    log.exception("%s: acking %d messages failed", self.name,
                                  len(claimed))
                ended.extend(c for c in claimed if c.batch.ended())
        except BaseException:  # the process dies: what it took is not acked (the
            self._completions.abandon()  # lease window); the next writer takes the rest
            raise
        finally:
            self._finishing.discard(me)
        for last in ended:
            await self._round_later(last.guard, last.batch, me)

    async def _round_ended(self, guard: BatchGuard, batch: Round,
                           me: asyncio.Task[Any]) -> None:
        if batch.ended():
            await self._round_later(guard, batch, me)

    async def _round_later(self, guard: BatchGuard, batch: Round,
                           me: asyncio.Task[Any]) -> None:
        """Every claim of ``batch`` is finished: the repeats of keys it held are
        duplicates now (or run, if the first copy failed)."""
        if batch.later:
            await self._claim_round(guard, [m for m in batch.later if not m.acked], me)

