"""AsyncConsumer: ``async def`` handlers on an event loop, the same guarantees as
:class:`~msgpatterns.Consumer`.

It is a second driver of the same core, not a second runtime: every outcome becomes a
decision through :func:`msgpatterns.settlement.settle` (hence
:meth:`RetryPolicy.decide`); messages are the same :class:`~msgpatterns.Message`
values with the same settle-once state; ordered mode uses the sync runtime's key gate.
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
import enum
import inspect
import logging
import signal
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, cast

from msgpatterns import headers as h
from msgpatterns._callables import is_async_callable, require_async_callable
from msgpatterns.aio.base import AsyncBroker
from msgpatterns.brokers.virtual_time import jump_to_next_due
from msgpatterns.consumer import ConsumerStats, _duration, _KeyGate, _Released, _topic_list
from msgpatterns.deadletter import DeadLetter, DeadLetterStore, format_traceback
from msgpatterns.deadlines import DeadlineTracker
from msgpatterns.errors import (
    AckTimeout,
    BrokerClosed,
    ConfigurationError,
    MalformedMessage,
    NeedRetry,
    describe,
    printable,
    seconds,
)
from msgpatterns.message import Message
from msgpatterns.retry import RetryPolicy
from msgpatterns.settlement import Ack, DeadLetterIt, Decision, RetryLater, RetryNow, settle
from msgpatterns.timer import TimingWheel

__all__ = ["AsyncConsumer", "AsyncHandler"]

log = logging.getLogger("msgpatterns.aio.consumer")

AsyncHandler = Callable[[Message], Any]

#: The AsyncConsumer whose handler task this is (stop() there only requests the stop).
_own_task: contextvars.ContextVar[AsyncConsumer | None] = contextvars.ContextVar(
    "msgpatterns_async_consumer", default=None)

#: Delay of a fallback redelivery when the retry policy could not decide.
_FALLBACK_DELAY = 1.0


class _LoopTimer:
    """What :class:`~msgpatterns.deadlines.DeadlineTracker` needs from a timing wheel,
    on the event loop: one ``call_later`` for the oldest deadline, not one per message.
    Once stopped it refuses to schedule (the tracker then stays disarmed)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._handles: set[asyncio.TimerHandle] = set()
        self._stopped = False

    def schedule(self, delay: float, fn: Callable[[], object]) -> asyncio.TimerHandle:
        if self._stopped:
            raise RuntimeError("the consumer's timer is stopped")
        handle: asyncio.TimerHandle

        def fire() -> None:
            self._handles.discard(handle)
            fn()

        handle = self._loop.call_later(delay, fire)
        self._handles.add(handle)
        return handle

    def stop(self) -> None:
        self._stopped = True
        for handle in self._handles:
            handle.cancel()
        self._handles.clear()


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class AsyncConsumer:
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
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise ConfigurationError(
                f"AsyncConsumer retry must be a RetryPolicy or None, got {type(retry).__name__}"
            )
        if dead_letters is not None and not callable(getattr(dead_letters, "put", None)):
            raise ConfigurationError(
                "AsyncConsumer dead_letters must be a DeadLetterStore (with put(record)) "
                f"or None, got {type(dead_letters).__name__}"
            )
        if not isinstance(group, str) or not group:
            raise ConfigurationError(
                f"AsyncConsumer group must be a non-empty string, got {group!r}")
        if name is not None and (not isinstance(name, str) or not name):
            raise ConfigurationError(
                f"AsyncConsumer name must be a non-empty string, got {name!r}")
        for option, value in (("max_in_flight", max_in_flight), ("fetch_batch", fetch_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(
                    f"AsyncConsumer {option} must be an int of at least 1, got {value!r}"
                )
        self.broker = broker
        self.handler = handler
        self.topics = _topic_list(topics)
        self.group = group
        self.max_in_flight = max_in_flight
        self.retry = retry if retry is not None else RetryPolicy()
        self.ordered = bool(ordered)
        self.ack_timeout = _duration(ack_timeout, "ack_timeout") or 0.0
        self.decoder = decoder
        self._async_decoder = decoder is not None and is_async_callable(decoder)
        self.dead_letters = dead_letters
        poll = _duration(poll_timeout, "poll_timeout")
        if not poll:
            raise ConfigurationError(
                f"AsyncConsumer poll_timeout must be positive, got {poll_timeout!r}")
        self.poll_timeout: float = poll
        self.shutdown_timeout = _duration(shutdown_timeout, "shutdown_timeout")
        self.fetch_batch = fetch_batch
        self.name = name or f"msgpatterns-async-{group}"
        self.handler_name = getattr(handler, "__qualname__", None) or repr(handler)
        self.stats = ConsumerStats()

        self._state = _State.NEW
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._in_flight: set[Message] = set()
        self._held: dict[Message, float] = {}  # ordered delayed retries: due (broker clock)
        self._timer: _LoopTimer | None = None
        self._deadlines: DeadlineTracker[Message] | None = None  # ack deadlines
        self._retry_timers: dict[Message, asyncio.TimerHandle] = {}
        self._running: set[asyncio.Task[None]] = set()  # handler and retry tasks
        self._settling: set[asyncio.Task[None]] = set()
        self._finishing: set[asyncio.Task[Any]] = set()  # handler tasks now settling
        self._gate: _KeyGate | None = None
        self._fetcher: asyncio.Task[None] | None = None
        self._changed: asyncio.Event | None = None
        self._stop_requested: asyncio.Event | None = None
        self._stopping: asyncio.Lock | None = None
        self._until_idle = False
        self._settled_count = 0
        # The settlement the task running handler_finished() awaits itself (no task).
        self._inline: Message | None = None
        self._inline_outcome: tuple[BaseException | None] | None = None

    # -- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Start fetching on the running loop and return."""
        if self._state is _State.RUNNING:
            return
        if self._state is _State.STOPPING:
            raise RuntimeError("the consumer is stopping")
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._changed = asyncio.Event()
        self._stop_requested = asyncio.Event()
        self._stopping = asyncio.Lock()
        self._gate = _KeyGate() if self.ordered else None
        self._timer = _LoopTimer(self._loop)
        self._deadlines = (
            DeadlineTracker(cast(TimingWheel, self._timer), self.ack_timeout, self._expire)
            if self.ack_timeout > 0 else None)
        self._state = _State.RUNNING
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
            self._state = _State.STOPPED
            return True
        async with self._stopping:
            return await self._stop(limit)

    async def _stop(self, limit: float | None) -> bool:
        if self._state in (_State.NEW, _State.STOPPED):
            self._state = _State.STOPPED
            return True
        self._state = _State.STOPPING
        self._notify()
        fetcher = self._fetcher
        if fetcher is not None:
            await asyncio.wait([fetcher])  # bounded by poll_timeout; hands back its fetch
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._drained(), limit)
        leftovers = list(self._in_flight)
        self._held.clear()
        for message in leftovers:
            handle = self._retry_timers.pop(message, None)
            if handle is not None:
                handle.cancel()
            message.expire(_Released("consumer stopped"))
        self._state = _State.STOPPED
        for task in list(self._running):
            if task not in self._finishing:  # a settlement in progress is let finish
                task.cancel()
        while self._running or self._settling:
            await asyncio.wait(list(self._running | self._settling))
        if self._timer is not None:
            self._timer.stop()
        for handle in self._retry_timers.values():
            handle.cancel()
        self._retry_timers.clear()
        assert self._stop_requested is not None
        self._stop_requested.set()
        return not leftovers

    async def _drained(self) -> None:
        while self._in_flight:
            await self._wait_change()

    def _request_stop(self) -> None:
        """Ask for a stop without waiting (from a handler, or a signal)."""
        if self._state is _State.RUNNING:
            self._state = _State.STOPPING
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
            if self._state is not _State.STOPPED:
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

    def _on_signal(self, sig: signal.Signals) -> None:
        log.info("%s: signal %s, shutting down", self.name, sig.name)
        if self._stop_requested is not None:
            self._stop_requested.set()

    @property
    def in_flight(self) -> int:
        """Messages fetched and not yet settled."""
        return len(self._in_flight)

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
        while self._state is _State.RUNNING:
            free = self.max_in_flight - len(self._in_flight)
            if free <= 0:
                # Full: only a held retry coming due can free a slot.
                if not (self._until_idle and self._nothing_active()
                        and self._jump(can_fetch=False)):
                    await self._wait_change(self.poll_timeout)
                continue
            until_idle = self._until_idle
            generation = self._settled_count
            messages = await self._fetch(min(free, self.fetch_batch),
                                         0.0 if until_idle else None)
            if self._state is not _State.RUNNING:
                await self._hand_back(messages)
                return
            if messages:
                self.stats.fetched += len(messages)
                for message in messages:
                    self._admit(message)
                continue
            if not until_idle:
                continue
            if not self._nothing_active():
                if self._settled_count == generation:
                    await self._wait_change(self.poll_timeout)
            elif not self._jump(can_fetch=True):
                if self._in_flight:  # holds due later in real time
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
            if self._state is _State.RUNNING:
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
        for message in messages:
            try:
                await self.broker.nack(message, 0.0)
                self.stats.released += 1
            except Exception:
                self.stats.broker_errors += 1
                log.exception("%s: handing message %s back failed", self.name, message.id)

    def _admit(self, message: Message) -> None:
        """A fetched message takes a slot, then runs now or waits behind its key."""
        message.bind(self._on_settle)
        self._in_flight.add(message)
        if self._gate is None or self._gate.admit(message):
            self._spawn(message)

    def _spawn(self, message: Message, delay: float = 0.0) -> None:
        task = asyncio.create_task(self._execute(message, delay))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    def _nothing_active(self) -> bool:
        """Every in-flight message is parked behind its key or held for a delayed
        retry: no handler or ack can change what becomes due."""
        parked = self._gate.parked if self._gate is not None else 0
        return len(self._in_flight) == parked + len(self._held)

    def _jump(self, *, can_fetch: bool) -> bool:
        """Nothing active: move virtual time to the next moment something can run (a
        held retry coming due, or - with a free slot - the broker's next due delivery)
        and release the holds now due. True when progress became possible."""
        try:
            fetchable = jump_to_next_due(self.broker, self.topics, self.group, self._held,
                                         can_fetch=can_fetch)
        except Exception:  # a closed broker, a refused jump: wait instead of dying
            self.stats.broker_errors += 1
            log.exception("%s: moving virtual time failed", self.name)
            return False
        if fetchable is None:
            return False
        now = self.broker.now()
        released = [m for m, at in self._held.items() if at <= now]
        for message in released:
            self._release_hold(message)
        return bool(released) or fetchable

    def _release_hold(self, message: Message) -> None:
        if self._held.pop(message, None) is None:
            return
        handle = self._retry_timers.pop(message, None)
        if handle is not None:
            handle.cancel()
        if self._state is not _State.STOPPED:
            self._spawn(message)
        self._notify()

    # -- one delivery ---------------------------------------------------------------

    async def _execute(self, message: Message, delay: float = 0.0) -> None:
        """Run the handler on ``message`` (after ``delay``: a local retry) and settle
        it; the settlement of its own outcome is awaited here, not in a new task."""
        _own_task.set(self)
        if delay > 0:
            await asyncio.sleep(delay)
        if message.acked:
            return  # handed back by stop() before it could run
        if self._deadlines is not None:
            self._deadlines.track(message)
        error: BaseException | None = None
        try:
            await self._call_handler(message)
        except asyncio.CancelledError as exc:
            if self._state is _State.STOPPED:
                raise  # stop() cancelled it; its message was handed back
            error = exc  # the handler's own cancellation fails the message
        except BaseException as exc:  # SystemExit & co fail the message, not the loop
            error = exc
        self._inline, self._inline_outcome = message, None
        try:
            message.handler_finished(error)
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

    def _expire(self, message: Message) -> None:
        error = AckTimeout(
            f"message {message.id} not acked within {self.ack_timeout:g}s "
            f"by handler {self.handler_name}"
        )
        if message.expire(error):
            self.stats.ack_timeouts += 1
            log.warning("%s; failing the delivery", error)

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
        """Turn the outcome into a decision (settlement.settle) and carry it out;
        whatever fails, the delivery is settled another way and its slot freed."""
        if self._deadlines is not None:
            self._deadlines.untrack(message)
        retry: Message | None = None
        delay = 0.0
        hold = False
        decision: Decision | None = None
        try:
            if isinstance(error, _Released):
                await self.broker.nack(message, 0.0)
                self.stats.released += 1
                return
            decision = self._decide(message, error)
            if isinstance(decision, Ack):
                await self.broker.ack(message)
                self.stats.acked += 1
                return
            assert error is not None
            self.stats.failed += 1
            self._log_failure(message, error, decision)
            if isinstance(decision, RetryNow):
                retry, delay = message.copy_for_retry(local=True), decision.delay
                self.stats.retried_locally += 1
            elif isinstance(decision, RetryLater):
                retry, delay, hold = await self._redeliver(message, decision)
                self.stats.redelivered += 1
            else:
                await self._dead_letter(message, decision.record)
                self.stats.dead_lettered += 1
        except Exception as failure:
            self.stats.broker_errors += 1
            retry, hold = None, False
            if not isinstance(error, _Released):
                await self._settle_otherwise(message, error, decision, failure)
        finally:
            self._release(message, retry, delay, hold)

    def _decide(self, message: Message, error: BaseException | None) -> Decision:
        try:
            return settle(message, error, policy=self.retry, now=self.broker.now(),
                          group=self.group)
        except Exception:
            return self._fallback_decision(message, error)

    def _fallback_decision(self, message: Message, error: BaseException | None) -> Decision:
        """The retry policy itself failed: an ack for a success, a dead letter once
        ``max_attempts`` is reached, else a redelivery after a short delay."""
        log.exception("%s: the retry policy failed on message %s", self.name, message.id)
        if error is None:
            return Ack()
        if message.attempt >= self.retry.max_attempts:
            reason = (f"gave up after {message.attempt} attempts: "
                      f"{type(error).__name__} (retry policy failed)")
            return DeadLetterIt(self._record(message, error, reason))
        headers = dict(message.headers)
        headers[h.ATTEMPT] = str(message.attempt + 1)
        return RetryLater(_FALLBACK_DELAY, error, headers)

    async def _redeliver(self, message: Message,
                         decision: RetryLater) -> tuple[Message | None, float, bool]:
        """The failure history goes into the headers (it survives the redelivery).
        Ordered: the retry stays here and keeps its key (a broker redelivery would let
        later messages of the key overtake it); otherwise nack(delay)."""
        failure = {k: v for k, v in decision.headers.items() if k != h.ATTEMPT}
        message.headers.update(failure)
        if self._gate is not None:
            retry = message.copy_for_retry(attempt=decision.attempt)
            retry.headers[h.ATTEMPT] = str(retry.attempt)
            return retry, decision.delay, True
        await self.broker.nack(message, decision.delay)
        return None, 0.0, False

    async def _dead_letter(self, message: Message, record: DeadLetter) -> None:
        log.error(
            "%s: message %s (key %r, topic %r) dead-lettered after %d attempt(s): %s",
            self.name, message.id, message.key, message.topic, message.attempt, record.reason,
        )
        await self._put_dead_letter(message, record)

    async def _put_dead_letter(self, message: Message, record: DeadLetter) -> None:
        store = self.dead_letters
        if store is not None:
            await asyncio.to_thread(store.put, record)
            await self.broker.ack(message)
        else:
            await self.broker.dead_letter(message, record)

    async def _settle_otherwise(self, message: Message, error: BaseException | None,
                                decision: Decision | None, failure: Exception) -> None:
        """The settlement raised ``failure``: a minimal dead letter when one was due,
        else a nack for redelivery (the durable attempt moves on)."""
        log.error("%s: settling message %s failed (%s); settling it another way",
                  self.name, message.id, describe(failure))
        if isinstance(decision, DeadLetterIt) or (
                decision is None and message.attempt >= self.retry.max_attempts):
            try:
                await self._put_dead_letter(message, self._fallback_record(message, error,
                                                                           failure))
                self.stats.dead_lettered += 1
                return
            except Exception:
                log.exception("%s: fallback dead letter of %s failed", self.name, message.id)
        try:
            await self.broker.nack(message, 0.0)
            self.stats.redelivered += 1
        except Exception:
            log.exception("%s: message %s could not be settled; the broker redelivers it "
                          "after its own timeout", self.name, message.id)

    def _record(self, message: Message, error: BaseException | None, reason: str) -> DeadLetter:
        now = self.broker.now()
        kind = type(error) if error is not None else Exception
        return DeadLetter(
            message=message,
            error_type=printable(f"{kind.__module__}.{kind.__qualname__}"),
            error_message=describe(error),
            traceback=format_traceback(error) if error is not None else "",
            attempts=message.attempt,
            first_failed_at=now,
            last_failed_at=now,
            reason=printable(reason),
            group=self.group,
        )

    def _fallback_record(self, message: Message, error: BaseException | None,
                         failure: Exception) -> DeadLetter:
        return self._record(message, error if error is not None else failure,
                            f"dead-lettered after a failed settlement: {describe(failure)}")

    def _release(self, message: Message, retry: Message | None, delay: float,
                 hold: bool) -> None:
        """Free the slot, or put the retry copy in its place (now, after ``delay``, or
        held until due); in ordered mode the key's next message may run."""
        self._in_flight.discard(message)
        if retry is not None and self._state is _State.STOPPED:
            retry = None
            self._start_hand_back(message)
        if retry is not None:
            retry.bind(self._on_settle)
            self._in_flight.add(retry)
            if self._gate is not None:
                self._gate.transfer(message, retry)
            if hold:
                assert self._loop is not None
                self._held[retry] = self.broker.now() + delay
                self._retry_timers[retry] = self._loop.call_later(
                    delay, self._release_hold, retry)
            else:
                self._spawn(retry, delay)
        elif self._gate is not None:
            following = self._gate.release(message)
            if following is not None and self._state is not _State.STOPPED:
                self._spawn(following)
        self._settled_count += 1
        self._notify()

    def _start_hand_back(self, message: Message) -> None:
        task = asyncio.create_task(self._hand_back([message], fetched=False))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    def _log_failure(self, message: Message, error: BaseException, decision: Decision) -> None:
        if isinstance(error, NeedRetry):
            log.debug("%s: message %s asked for a retry (%s)", self.name, message.id, error)
        elif isinstance(decision, (RetryNow, RetryLater)):
            what = "retry locally" if isinstance(decision, RetryNow) else "redeliver"
            log.warning(
                "%s: handler %s failed on message %s (attempt %d): %s: %s; %s in %.3gs",
                self.name, self.handler_name, message.id, message.attempt,
                type(error).__name__, describe(error), what, decision.delay,
            )
