"""AsyncConsumer: ``async def`` handlers on an event loop, the same guarantees as
:class:`~msgpatterns.Consumer`.

It is a second driver of the same parts (:mod:`msgpatterns.runtime`), not a second
runtime: every outcome goes through the same settler (:meth:`RetryPolicy.decide` ->
broker operations -> counts, awaited by :mod:`msgpatterns.runtime.async_settling` with
:func:`~msgpatterns.runtime.settler.run_async`); the slots, the retry scheduler and its
clock, the idle driver, ordered mode's key gate and the claim rounds of ``@idempotent``
handlers are the thread driver's own.
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
  stopping (handed back). Local retries wait on the retry scheduler (a loop timer, or
  virtual time under ``run_until_idle`` on the fake), holding their slot; redeliveries
  go through the broker's ``nack(delay)``; the last allowed failure is dead-lettered.
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
* Batch handlers (``batch=True``) on the thread driver's rules
  (:mod:`msgpatterns.runtime.batches`, awaited by :mod:`msgpatterns.runtime.async_batches`).
* Telemetry and health as the thread driver's: the same counts and CONSUMER spans
  reported to the listener, and :meth:`AsyncConsumer.health` (safe from any thread).
* ``await stop(timeout)``: no fetch starts; in-flight work may finish until
  ``timeout``; then every message still unsettled is handed back to the broker and the
  handler tasks still running are cancelled and awaited. When it returns no handler of
  this consumer runs again and every task it started has ended.
* ``await aclose()`` (or the end of ``async with``): the stop, then the consumer is
  closed for good (``ClosedError`` on a later start); the broker and the checkers it was
  given stay open for whoever made them.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import logging
import signal
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any, cast

from msgpatterns._callables import is_async_callable, require_async_callable
from msgpatterns.aio.base import AsyncBroker
from msgpatterns.deadletter import DeadLetterStore
from msgpatterns.deadlines import DeadlineTracker
from msgpatterns.errors import (
    ConfigurationError,
    MalformedMessage,
    describe,
    seconds,
)
from msgpatterns.idempotency.batch import guard_of
from msgpatterns.message import Message
from msgpatterns.observability import stats as _obs
from msgpatterns.observability.stats import DeliveryScope, Health
from msgpatterns.retry import RetryPolicy
from msgpatterns.runtime.async_batches import AsyncBatches
from msgpatterns.runtime.async_fetcher import AsyncFetcher
from msgpatterns.runtime.async_flow import AsyncFlow
from msgpatterns.runtime.async_rounds import AsyncRounds
from msgpatterns.runtime.async_settling import AsyncSettling
from msgpatterns.runtime.clock import LoopTimer, VirtualClock
from msgpatterns.runtime.driver import DriverBase, ack_deadline_passed
from msgpatterns.runtime.gate import KeyGate
from msgpatterns.runtime.health import health_snapshot, on_loop
from msgpatterns.runtime.lifecycle import Released, State
from msgpatterns.runtime.options import check_batch
from msgpatterns.runtime.stats import ConsumerStats

__all__ = ["AsyncBatchHandler", "AsyncConsumer", "AsyncHandler"]

log = logging.getLogger("msgpatterns.aio.consumer")

AsyncHandler = Callable[[Message], Any]
#: A batch handler (``AsyncConsumer(..., batch=True)``): awaited with a list of messages.
AsyncBatchHandler = Callable[[list[Message]], Any]

#: The AsyncConsumer whose handler task this is (stop() there only requests the stop).
_own_task: contextvars.ContextVar[AsyncConsumer | None] = contextvars.ContextVar(
    "msgpatterns_async_consumer", default=None)

class AsyncConsumer(DriverBase):
    """Runs ``await handler(message)`` for every message of ``topics`` in ``group``.

    Args:
        broker: an :class:`~msgpatterns.aio.base.AsyncBroker`.
        handler: an ``async def handler(message)``; return to ack, raise to fail. A
            sync callable is refused with ``TypeError`` (use :class:`~msgpatterns.Consumer`).
            With ``batch=True``: ``async def handler(messages)``, see below.
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
        fetch_batch: most messages one fetch asks for (and the largest batch a batch
            handler receives).
        name: for logs.
        batch: the handler is a batch handler, with :class:`~msgpatterns.Consumer`'s
            semantics: it is awaited with a list of up to ``fetch_batch`` ready
            messages and every message is still settled on its own - returning acks
            every message it did not settle itself, raising fails every one,
            :class:`~msgpatterns.errors.PartialFailure` fails only those it names,
            ``message.ack(error)`` / ``message.disable_auto_ack()`` work per message;
            each failed message goes through the retry policy alone. An
            ``@idempotent`` batch handler on a lease checker has the keys of each
            batch claimed in one round trip and receives only the claimed messages.
            Not with ``ordered=True`` (ConfigurationError).

    Telemetry and health are the :class:`~msgpatterns.Consumer`'s: the same counts
    reported to the telemetry listener (``msgpatterns.consumer.fetched`` ...), one
    CONSUMER span per delivery attempt (opened in the worker task that runs the
    handler: it is the current span inside the handler), and :meth:`health` for
    :class:`~msgpatterns.observability.HealthServer`.

    ``async with AsyncConsumer(...) as consumer:`` starts it and, at the block's end,
    closes it (:meth:`aclose`: the stop with ``shutdown_timeout``); the broker stays
    the caller's, so ``async with broker, AsyncConsumer(broker, ...):`` closes both,
    the consumer first. The sync twin is :class:`~msgpatterns.Consumer`.
    """

    #: Seconds :meth:`health`, called from another thread, waits for the event loop to
    #: take the snapshot; a loop that does not answer in time is reported not running.
    health_timeout: float = 1.0

    broker: AsyncBroker

    def __init__(
        self,
        broker: AsyncBroker,
        handler: AsyncHandler | AsyncBatchHandler,
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
        batch: bool = False,
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
        check_batch("AsyncConsumer", batch=batch, ordered=ordered)
        self.handler: Callable[[Any], Any] = handler
        self.batch = batch
        self._async_decoder = decoder is not None and is_async_callable(decoder)
        #: The batch claims of an async @idempotent handler on a lease checker (None:
        #: plain, or one transaction per message).
        guard = guard_of(handler, batch=batch)
        #: A RetryPolicy whose decide() is overridden sees every success too.
        self._plain_decide = type(self.retry).decide is RetryPolicy.decide

        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: LoopTimer | None = None  # ack deadlines and retry timers
        self._deadlines: DeadlineTracker[Message] | None = None  # ack deadlines
        self._workers: list[asyncio.Task[None]] = []
        self._finishing: set[asyncio.Task[Any]] = set()  # workers now settling
        self._fetcher: asyncio.Task[None] | None = None
        self._stop_requested: asyncio.Event | None = None
        self._stopping: asyncio.Lock | None = None
        #: The slots, the ready queue, the retry scheduler and the wake-ups.
        self._flow = AsyncFlow(self.stats, VirtualClock(None, broker.now))
        #: Where deliveries report their outcome (settler -> broker -> freed slot).
        self._settling = AsyncSettling(
            broker=broker, settler=self._settler, flow=self._flow,
            dead_letters=dead_letters, reporter=self._reporter, log=log)
        self._settler.rebind = self._settling.on_settled
        #: The fetch loop, the workers' top-ups and the jumps of virtual time.
        self._fetching = AsyncFetcher(
            broker=broker, topics=self.topics, group=group, max_in_flight=max_in_flight,
            fetch_batch=fetch_batch, poll_timeout=self.poll_timeout, stats=self.stats,
            count=self._reporter.count, flow=self._flow, settling=self._settling,
            request_stop=self._request_stop, log=log, name=self.name)
        #: The claim rounds of an @idempotent handler on a lease checker.
        rounds = None if guard is None else AsyncRounds(
            guard, flow=self._flow, settling=self._settling, finishing=self._finishing,
            settle_unrun=self._settle_unrun, log=log, start_scope=self._start_scope)
        self._unwatch: Callable[[], None] | None = None
        #: The batch runs (None: a plain per-message handler).
        self._batches = None if guard is None and not batch else AsyncBatches(
            handler=handler, batch=batch, rounds=rounds, settling=self._settling,
            flow=self._flow, finishing=self._finishing,
            decode=None if decoder is None else self._decode,
            settle_unrun=self._settle_unrun, start_scope=self._start_scope,
            fetch_batch=fetch_batch, log=log, name=self.name)

    @property
    def _state(self) -> State:
        """The lifecycle state (kept by the flow)."""
        return self._flow.state

    @_state.setter
    def _state(self, state: State) -> None:
        self._flow.state = state

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Start fetching on the running loop and return. Raises
        :class:`~msgpatterns.errors.ClosedError` after :meth:`aclose`."""
        self._check_open()
        if self._state is State.RUNNING:
            return
        if self._state is State.STOPPING:
            raise RuntimeError("the consumer is stopping")
        loop = self._loop = asyncio.get_running_loop()
        self._stop_requested = asyncio.Event()
        self._stopping = asyncio.Lock()
        self._timer = LoopTimer(loop)
        gate = KeyGate() if self.ordered else None
        self._flow.reset(loop, self._retry_clock(self._timer, self._fetching.until_idle), gate)
        self._deadlines = (
            DeadlineTracker(self._timer, self.ack_timeout, partial(
                ack_deadline_passed, ack_timeout=self.ack_timeout,
                handler_name=self.handler_name, stats=self.stats,
                count=self._reporter.count, log=log, settler=self._settler))
            if self.ack_timeout > 0 else None)
        self._settling.reset(loop, self._deadlines)
        if self._batches is not None:
            self._batches.deadlines = self._deadlines
        self._choose_paths()
        self._unwatch = _obs.watch_listener(self._choose_paths)
        self._state = State.RUNNING
        # One long-lived worker per slot: never more handlers run than messages held.
        self._workers = [asyncio.create_task(self._work(), name=f"{self.name}-worker-{i}")
                         for i in range(self.max_in_flight)]
        self._fetcher = asyncio.create_task(self._fetching.loop(), name=f"{self.name}-fetch")
        self._fetcher.add_done_callback(self._fetcher_ended)

    def _choose_paths(self) -> None:
        """The one hot-path switch, at start and whenever the telemetry listener
        changes: with no key gate, no overridden decide and no listener, a handler's
        success is a plain broker ack and a freed slot, settled by its worker
        (:meth:`AsyncSettling.choose`). Nothing per message tests it again."""
        self._settling.choose(plain_acks=not self.ordered and self._plain_decide)

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
        # In-flight work gets ``limit`` from the call, as with the thread driver,
        # however long the fetch in progress takes to come back.
        give_up = None if limit is None else time.monotonic() + limit
        fetcher = self._fetcher
        if fetcher is not None:
            await asyncio.wait([fetcher])  # bounded by poll_timeout; hands back its fetch
        left = None if give_up is None else max(0.0, give_up - time.monotonic())
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._drained(), left)
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
        unwatch, self._unwatch = self._unwatch, None
        if unwatch is not None:
            unwatch()
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
        self._check_open()
        self._fetching.until_idle = True
        await self.start()
        assert self._stop_requested is not None
        try:
            await asyncio.wait_for(self._stop_requested.wait(), limit)
        except TimeoutError:
            self._fetching.until_idle = False
            await self.stop(0)
            raise TimeoutError(f"{self.name} not idle after {limit}s: {self.stats}") from None
        self._fetching.until_idle = False
        await self.stop(self.shutdown_timeout)
        return self.stats

    async def aclose(self) -> None:
        """Stop (``stop(shutdown_timeout)``), then close what the consumer owns; it never
        starts again (:meth:`start`, :meth:`run`, :meth:`run_until_idle` raise
        :class:`~msgpatterns.errors.ClosedError`). Idempotent. What it owns is what it
        started - its tasks and timers; the broker, the checkers and a ``dead_letters``
        store it was given stay open for whoever made them (see
        :meth:`Consumer.close <msgpatterns.Consumer.close>`)."""
        self._closed = True
        await self.stop(self.shutdown_timeout)

    async def __aenter__(self) -> AsyncConsumer:
        """Start the consumer (:meth:`start`); the block's end closes it (:meth:`aclose`)."""
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def in_flight(self) -> int:
        """Messages fetched and not yet settled."""
        return len(self._flow.slots)

    def health(self) -> Health:
        """A snapshot of this consumer's health, of the same shape as
        :meth:`Consumer.health() <msgpatterns.Consumer.health>` (cheap: no broker call
        unless the broker has a ``connected`` property).

        Safe from any thread. The consumer's state lives on its event loop: called on
        that loop (or while the consumer is not running) the snapshot is taken at
        once; called from another thread (as
        :class:`~msgpatterns.observability.HealthServer` calls it) it is taken on the
        loop (``call_soon_threadsafe``) while the caller waits up to
        :attr:`health_timeout` seconds. A loop that does not answer in time (a
        handler blocking it, the loop stopped) is reported not running: ``running``
        (so ``live``) is False, the other figures are read as they stand."""
        loop = None if self._state in (State.NEW, State.STOPPED) else self._loop
        health = on_loop(loop, self._health_now, self.health_timeout)
        return self._health_now(loop_answered=False) if health is None else health

    def _health_now(self, *, loop_answered: bool = True) -> Health:
        flow = self._flow
        held_since = list(flow.slots.held.values())
        fetcher = self._fetcher
        alive = (loop_answered and fetcher is not None and not fetcher.done()
                 and all(not task.done() for task in self._workers))
        return health_snapshot(name=self.name, state=self._state, alive=alive,
                               held_since=held_since, in_flight=len(held_since),
                               last_fetch=self._fetching.last_fetch, broker=self.broker)

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("%s: signal %s, shutting down", self.name, sig.name)
        if self._stop_requested is not None:
            self._stop_requested.set()

    # -- the workers ------------------------------------------------------------------

    async def _work(self) -> None:
        """One worker: run the ready messages one after another until the run stops;
        the settlement of each handler's own outcome is awaited here, not in a task."""
        _own_task.set(self)
        me = asyncio.current_task()
        assert me is not None
        flow, settling, finishing = self._flow, self._settling, self._finishing
        fetching = self._fetching
        ready = flow.ready
        handler = self.handler if self.decoder is None else self._decode_and_call
        deadlines, batches = self._deadlines, self._batches
        while True:
            if not ready and not flow.fetching and fetching.may_top_up():
                finishing.add(me)  # a fetch is not cancelled: what it brings is handed back
                try:
                    await fetching.top_up()
                finally:
                    finishing.discard(me)
            item = ready.popleft() if ready else await flow.next()
            if item is None or self._state is State.STOPPED:
                return
            if batches is not None:  # batch claims, or a batch handler
                await batches.item(item)
                continue
            message = cast(Message, item)
            if message.acked:
                continue  # handed back by stop() before it could run
            if deadlines is not None:
                deadlines.track(message)
            listener = _obs.listener
            scope = None if listener is None else self._start_scope(listener, message)
            error: BaseException | None = None
            try:
                await handler(message)
            except asyncio.CancelledError as exc:
                if flow.state is State.STOPPED:
                    if scope is not None:
                        _obs.report(scope.close)
                    raise  # stop() cancelled it; its message was handed back
                error = exc  # the handler's own cancellation fails the message
            except BaseException as exc:  # SystemExit & co fail the message, not the loop
                error = exc
            if scope is not None:
                await self._settle_observed(message, error, scope, me)
                continue
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

    async def _settle_observed(self, message: Message, error: BaseException | None,
                               scope: DeliveryScope, me: asyncio.Task[Any] | None) -> None:
        """Settle a run whose telemetry scope is open (the settlement runs inside the
        delivery's trace context, as with the thread driver), then close the scope;
        ``me``: the worker, marked finishing meanwhile (a stop lets it end)."""
        _obs.report(scope.handler_returned, error)
        try:
            outcome = self._settling.finish(message, error)
            if outcome is not None:
                if me is not None:
                    self._finishing.add(me)
                try:
                    await self._settling.settle(message, outcome[0])
                finally:
                    if me is not None:
                        self._finishing.discard(me)
        finally:
            _obs.report(scope.close)

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

    # -- messages whose handler does not run ----------------------------------------

    async def _settle_unrun(self, message: Message, error: BaseException | None) -> None:
        """Settle a message whose handler does not run (a duplicate: success; a key in
        progress, a missing key, a malformed body: ``error``), observed like a run."""
        listener = _obs.listener
        scope = None if listener is None else self._start_scope(listener, message)
        if scope is not None:
            await self._settle_observed(message, error, scope, None)
            return
        outcome = self._settling.finish(message, error)
        if outcome is not None:
            await self._settling.settle(message, outcome[0])
