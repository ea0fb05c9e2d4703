"""AsyncConsumer: ``async def`` handlers on an event loop, the same guarantees as
:class:`~msgpatterns.Consumer`.

It is a second driver of the same parts (:mod:`msgpatterns.runtime`), not a second
runtime: every outcome goes through the same settler (:meth:`RetryPolicy.decide` ->
broker operations -> counts, awaited here with
:func:`~msgpatterns.runtime.settler.run_async`); the slots, the retry scheduler and its
clock, the idle driver and ordered mode's key gate are the thread driver's own.
Only the waiting differs: tasks and ``asyncio`` timers instead of threads and a wheel.

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
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

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
from msgpatterns.message import Message
from msgpatterns.retry import RetryPolicy
from msgpatterns.runtime.clock import LoopTimer, VirtualClock
from msgpatterns.runtime.driver import DriverBase
from msgpatterns.runtime.flow import Slots
from msgpatterns.runtime.gate import KeyGate
from msgpatterns.runtime.idle import jump_or_none
from msgpatterns.runtime.lifecycle import Released, State
from msgpatterns.runtime.scheduler import RetryScheduler
from msgpatterns.runtime.settler import Settled, run_async
from msgpatterns.runtime.stats import ConsumerStats

__all__ = ["AsyncConsumer", "AsyncHandler"]

log = logging.getLogger("msgpatterns.aio.consumer")

AsyncHandler = Callable[[Message], Any]

#: The AsyncConsumer whose handler task this is (stop() there only requests the stop).
_own_task: contextvars.ContextVar[AsyncConsumer | None] = contextvars.ContextVar(
    "msgpatterns_async_consumer", default=None)

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
            counts={}, rebind=self._on_settle, log=log)
        self.handler = handler
        self._async_decoder = decoder is not None and is_async_callable(decoder)

        self._state = State.NEW
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._timer: LoopTimer | None = None  # ack deadlines and retry timers
        self._deadlines: DeadlineTracker[Message] | None = None  # ack deadlines
        self._running: set[asyncio.Task[None]] = set()  # handler tasks
        self._settling: set[asyncio.Task[None]] = set()
        self._finishing: set[asyncio.Task[Any]] = set()  # handler tasks now settling
        self._fetcher: asyncio.Task[None] | None = None
        self._changed: asyncio.Event | None = None
        self._stop_requested: asyncio.Event | None = None
        self._stopping: asyncio.Lock | None = None
        self._until_idle = False
        self._gate: KeyGate | None = None
        #: Delayed retries and the slots (made per start(): on the loop, or virtual).
        self._scheduler: RetryScheduler[Message] = RetryScheduler(
            VirtualClock(None, broker.now), self._retry_due)
        self._slots = Slots(self.stats, None, self._scheduler)
        # The settlement the task running handler_finished() awaits itself (no task).
        self._inline: Message | None = None
        self._inline_outcome: tuple[BaseException | None] | None = None

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Start fetching on the running loop and return."""
        if self._state is State.RUNNING:
            return
        if self._state is State.STOPPING:
            raise RuntimeError("the consumer is stopping")
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._changed = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self._stopping = asyncio.Lock()
        self._timer = LoopTimer(self._loop)
        self._gate = KeyGate() if self.ordered else None
        self._scheduler = RetryScheduler(self._retry_clock(self._timer, self._until_idle),
                                         self._retry_due)
        self._slots = Slots(self.stats, self._gate, self._scheduler)
        self._deadlines = (
            DeadlineTracker(self._timer, self.ack_timeout, self._deadline)
            if self.ack_timeout > 0 else None)
        self._state = State.RUNNING
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
        self._state = State.STOPPING
        self._notify()
        fetcher = self._fetcher
        if fetcher is not None:
            await asyncio.wait([fetcher])  # bounded by poll_timeout; hands back its fetch
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._drained(), limit)
        leftovers = list(self._slots.held)
        self._scheduler.clear()
        for message in leftovers:
            message.delivery.expire(message, Released("consumer stopped"))
        self._state = State.STOPPED
        for task in list(self._running):
            if task not in self._finishing:  # a settlement in progress is let finish
                task.cancel()
        while self._running or self._settling:
            await asyncio.wait(list(self._running | self._settling))
        if self._timer is not None:
            self._timer.stop()
        self._scheduler.clear()
        assert self._stop_requested is not None
        self._stop_requested.set()
        return not leftovers

    async def _drained(self) -> None:
        while self._slots:
            await self._wait_change()

    def _request_stop(self) -> None:
        """Ask for a stop without waiting (from a handler, or a signal)."""
        if self._state is State.RUNNING:
            self._state = State.STOPPING
            self._notify()
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
        return len(self._slots)

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("%s: signal %s, shutting down", self.name, sig.name)
        if self._stop_requested is not None:
            self._stop_requested.set()

    # -- fetching -------------------------------------------------------------------

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _wait_change(self, timeout: float | None = None) -> None:
        """Wait until something changed since the event was last cleared."""
        changed = self._changed
        assert changed is not None
        if not changed.is_set():
            if timeout is None:
                await changed.wait()
            else:
                try:
                    await asyncio.wait_for(changed.wait(), timeout)
                except TimeoutError:
                    return
        changed.clear()

    async def _fetch_loop(self) -> None:
        """Fetch while slots are free, start what may run, and (until idle) move
        virtual time when nothing can; exits when the consumer stops."""
        while self._state is State.RUNNING:
            free = self.max_in_flight - len(self._slots)
            if free <= 0:
                # Full: only a held retry coming due can free a slot.
                if not (self._until_idle and self._slots.nothing_active()
                        and self._jump(can_fetch=False)):
                    await self._wait_change(self.poll_timeout)
                continue
            until_idle = self._until_idle
            generation = self._slots.settled
            messages = await self._fetch(min(free, self.fetch_batch),
                                         0.0 if until_idle else None)
            if self._state is not State.RUNNING:
                await self._hand_back(messages)
                return
            if messages:
                self.stats.fetched += len(messages)
                for message in messages:
                    self._admit(message)
                continue
            if not until_idle:
                continue
            if not self._slots.nothing_active():
                if self._slots.settled == generation:
                    await self._wait_change(self.poll_timeout)
            elif not self._jump(can_fetch=True):
                if self._slots:  # retries due later in real time
                    await self._wait_change(self.poll_timeout)
                else:
                    self._request_stop()
                    return

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

    async def _hand_back(self, messages: list[Message], *, fetched: bool = True) -> None:
        """Nack ``messages`` unprocessed (a fetch that returned after the stop began,
        or a retry copy made after it)."""
        if fetched:
            self.stats.fetched += len(messages)
        errors = await run_async(self._settler.hand_back(messages), self.broker, None)
        self.stats.released += len(messages) - errors
        self.stats.broker_errors += errors

    def _admit(self, message: Message) -> None:
        """A fetched message takes a slot, then runs now or waits behind its key."""
        message.delivery.bind(self._on_settle)
        self._slots.take((message,))
        if self._gate is None or self._gate.admit(message):
            self._spawn(message)

    def _spawn(self, message: Message) -> None:
        task = asyncio.create_task(self._execute(message))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _jump(self, *, can_fetch: bool) -> bool:
        """Nothing active: move virtual time to the next moment something can run
        (:func:`msgpatterns.runtime.idle.jump`) and start the retries now due. True
        when progress became possible."""
        moved = jump_or_none(self.broker, self.topics, self.group, self._scheduler,
                             can_fetch=can_fetch, stats=self.stats, count=self._count,
                             log=log, name=self.name)
        if moved is None:
            return False
        fetchable, due = moved
        for message in due:
            self._spawn(message)
        if due:
            self._notify()
        return bool(due) or fetchable

    def _retry_due(self, message: Message) -> None:
        """A retry's timer fired (on the loop): run it."""
        if self._scheduler.take(message) and self._state is not State.STOPPED:
            self._spawn(message)
        self._notify()

    # -- one delivery ---------------------------------------------------------------

    async def _execute(self, message: Message) -> None:
        """Run the handler on ``message`` and settle it; the settlement of its own
        outcome is awaited here, not in a new task."""
        _own_task.set(self)
        if message.acked:
            return  # handed back by stop() before it could run
        if self._deadlines is not None:
            self._deadlines.track(message)
        error: BaseException | None = None
        try:
            await self._call_handler(message)
        except asyncio.CancelledError as exc:
            if self._state is State.STOPPED:
                raise  # stop() cancelled it; its message was handed back
            error = exc  # the handler's own cancellation fails the message
        except BaseException as exc:  # SystemExit & co fail the message, not the loop
            error = exc
        self._inline, self._inline_outcome = message, None
        try:
            message.delivery.finish(message, error)
        finally:
            outcome, self._inline, self._inline_outcome = self._inline_outcome, None, None
        if outcome is not None:
            task = asyncio.current_task()
            assert task is not None
            self._finishing.add(task)
            try:
                await self._settle(message, outcome[0])
            finally:
                self._finishing.discard(task)

    async def _call_handler(self, message: Message) -> None:
        decoder = self.decoder
        if decoder is not None:
            try:
                body = decoder(message.raw_body)
                message.body = await body if self._async_decoder else body
            except Exception as exc:
                raise MalformedMessage(f"cannot decode body: {describe(exc)}") from exc
        await self.handler(message)

    def _on_settle(self, message: Message, error: BaseException | None) -> None:
        """Message callback (once per delivery, on any thread): carry out the
        settlement on the loop."""
        if threading.get_ident() != self._loop_thread:
            loop = self._loop
            assert loop is not None
            try:
                loop.call_soon_threadsafe(self._start_settling, message, error)
            except RuntimeError:  # the loop is closed: stop() handed it back already
                log.warning("%s: late settlement of %s after the loop closed", self.name,
                            message.id)
            return
        if self._inline is message:
            self._inline_outcome = (error,)
            return
        self._start_settling(message, error)

    def _start_settling(self, message: Message, error: BaseException | None) -> None:
        task = asyncio.create_task(self._settle(message, error))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle(self, message: Message, error: BaseException | None) -> None:
        """Carry out the settler's settlement (awaiting its broker operations); whatever
        fails, the delivery is settled another way and its slot freed."""
        if self._deadlines is not None:
            self._deadlines.untrack(message)
        settled = Settled(["broker_errors"])
        try:
            settled = await run_async(self._settler.settle(message, error), self.broker,
                                      self.dead_letters)
        finally:
            self._release(message, settled)

    def _release(self, message: Message, settled: Settled) -> None:
        """Free the slot, or give it to the retry copy (now, or scheduled); in ordered
        mode the key's next message may run."""
        run, give_back = self._slots.free(message, settled,
                                          stopped=self._state is State.STOPPED)
        if give_back:
            self._start_hand_back(message)
        if run is not None and self._state is not State.STOPPED:
            self._spawn(run)
        self._notify()

    def _start_hand_back(self, message: Message) -> None:
        task = asyncio.create_task(self._hand_back([message], fetched=False))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

