"""The consumer runtime: fetch -> handler -> ack / retry / dead letter, for any broker.

Guarantees:

* Flow control: never more than ``max_in_flight`` messages fetched and not yet settled
  (waiting to run, running, awaiting an explicit ack, or waiting for a local retry).
* Every delivery is settled exactly once, by the first of: the handler returning
  (auto ack), an explicit ``message.ack``, the handler raising, the ack deadline, or
  the consumer stopping. The outcome goes through :meth:`RetryPolicy.decide`.
* ``stop(timeout)`` stops fetching, lets in-flight work finish until ``timeout``, then
  hands every message still unsettled back to the broker: nothing is lost. When it
  returns, no handler of the consumer runs again and every thread it started is gone.
* A settlement that fails (the broker call raises, the dead-letter record cannot be
  sent) is settled another way - a fallback dead letter, or a nack for redelivery -
  never left hanging.
* In ordered mode a key's messages run one at a time in delivery order; a message
  being retried holds its key, so later messages of that key wait (other keys go on).
* Batches: an ``@idempotent`` handler's messages are claimed many at a time (one
  ``claim_many`` round trip per batch taken from the fetched messages); each claim is
  completed as soon as its own handler returned - a writer thread completes those
  that returned meanwhile in one ``complete_many`` while the workers run the next
  handlers - and each ack goes out only after its completion returned (DONE before
  ack). Neither the ack deadline nor a stop takes the claim of a handler that is still
  running. A batch handler (``batch=True``) receives a list of messages and settles
  each message on its own (see :class:`Consumer`).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from msgpatterns._callables import is_async_callable, require_sync_callable
from msgpatterns._escape import escape_control
from msgpatterns.brokers.base import Broker
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
from msgpatterns.ordering.executor import OrderedExecutor
from msgpatterns.retry import RetryPolicy
from msgpatterns.runtime.driver import DriverBase
from msgpatterns.runtime.fetcher import Fetcher
from msgpatterns.runtime.gate import KeyGate, ordering_key
from msgpatterns.runtime.health import health_snapshot
from msgpatterns.runtime.lifecycle import Released
from msgpatterns.runtime.lifecycle import State as _State
from msgpatterns.runtime.options import check_batch, topic_list
from msgpatterns.runtime.options import duration as _options_duration
from msgpatterns.runtime.settling import ThreadSettling
from msgpatterns.runtime.stats import ConsumerStats
from msgpatterns.runtime.thread_batches import ThreadBatches
from msgpatterns.runtime.thread_rounds import ThreadRounds
from msgpatterns.timer import TimingWheel

if TYPE_CHECKING:
    from msgpatterns.observability.stats import DeliveryScope, Health

__all__ = ["BatchHandler", "Consumer", "ConsumerStats", "Handler"]

log = logging.getLogger("msgpatterns.consumer")

Handler = Callable[[Message], Any]
#: A batch handler (``Consumer(..., batch=True)``): receives a list of messages.
BatchHandler = Callable[[list[Message]], Any]


#: Former private names, kept for code that imported them.
_Released = Released
_KeyGate = KeyGate


#: Per thread: the Consumer whose worker, pump or lane thread this is (stop() from
#: one of them only requests the stop: waiting there would wait for itself).
_own_thread = threading.local()


class Consumer(DriverBase):
    """Runs ``handler`` for every message of ``topics`` in consumer ``group``.

    Args:
        broker: any :class:`~msgpatterns.brokers.base.Broker`.
        handler: ``handler(message)``; return to ack, raise to fail (see RetryPolicy).
            A plain (sync) callable: an ``async def`` is refused with ``TypeError``
            (it would "finish" before its body ran; use
            :class:`~msgpatterns.aio.AsyncConsumer`).
            With ``batch=True``: ``handler(messages)``, see below.
        topics: topics (streams, queues) to consume.
        group: consumer group; each group receives every message once (at least).
        workers: handler threads.
        retry: the :class:`RetryPolicy` (default ``RetryPolicy()``).
        ordered: process each ``message.key`` serially in delivery order.
        max_in_flight: most messages held at once (fetched and not yet settled).
        ack_timeout: seconds a delivery may stay unsettled before it is failed
            (0: no deadline).
        decoder: turns ``message.raw_body`` into ``message.body`` before the handler;
            a decoder error is a :class:`~msgpatterns.errors.MalformedMessage` and goes
            straight to the dead-letter store. Sync only, like the handler.
        dead_letters: a store for dead letters instead of the broker's own.
        poll_timeout: longest a fetch waits for new messages (bounds ``stop`` latency);
            positive.
        shutdown_timeout: how long ``run()`` lets in-flight work finish on SIGTERM.
        fetch_batch: most messages one fetch asks the broker for (and the largest
            batch a batch handler receives).
        batch: the handler is a batch handler: it receives a list of up to
            ``fetch_batch`` messages (what one fetch brought, or retries) and every
            message is still settled on its own. Returning acks every message it did
            not settle itself; raising fails every one with that error; raising
            :class:`~msgpatterns.errors.PartialFailure` (message -> exception) fails
            only those; ``message.ack(error)`` / ``message.disable_auto_ack()`` work
            per message as for a per-message handler. Each failed message goes through
            the retry policy alone (local retries, redelivery, dead letter with its own
            attempt count). Not with ``ordered=True`` (ConfigurationError).

    An ``@idempotent`` handler (per-message or batch) on a lease checker (MemoryChecker,
    RedisChecker, SqlChecker) has its keys claimed per batch of messages in one store
    round trip, each completed as its handler returns (those that return together in
    one), DONE written before the ack; duplicates and keys in progress are settled
    without running it. On TransactionalSqlChecker each message
    keeps its own transaction (claim, writes and commit together), one at a time.
    Every argument is checked here: a wrong kind or value raises
    :class:`~msgpatterns.errors.ConfigurationError` naming it (``TypeError`` for an
    ``async def`` handler or decoder). Durations take seconds or a ``timedelta`` and
    refuse negative, NaN, infinite and absurdly large values in every form.

    A handler that raises a ``BaseException`` that is not an ``Exception``
    (``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``, a custom subclass) fails
    that message like any exception - it goes through the retry policy and ends in a
    dead letter after ``max_attempts`` - and the worker and the consumer keep running.
    To stop the consumer from a handler, call :meth:`stop` there.
    """

    broker: Broker

    def __init__(
        self,
        broker: Broker,
        handler: Handler | BatchHandler,
        *,
        topics: Sequence[str],
        group: str,
        workers: int = 1,
        retry: RetryPolicy | None = None,
        ordered: bool = False,
        max_in_flight: int = 100,
        ack_timeout: float | timedelta = 900.0,
        decoder: Callable[[Any], Any] | None = None,
        dead_letters: DeadLetterStore | None = None,
        poll_timeout: float | timedelta = 0.25,
        shutdown_timeout: float | timedelta | None = 30.0,
        fetch_batch: int = 64,
        name: str | None = None,
        batch: bool = False,
    ) -> None:
        if not isinstance(broker, Broker) or is_async_callable(getattr(broker, "fetch", None)):
            raise ConfigurationError(
                f"Consumer broker must implement the Broker protocol (fetch, ack, nack, "
                f"dead_letter, publish, now, close), got {type(broker).__name__} (an "
                f"asyncio broker goes with msgpatterns.aio.AsyncConsumer)"
            )
        require_sync_callable(handler, what="handler", where="Consumer",
                              alternative="msgpatterns.AsyncConsumer (async def handlers)")
        if decoder is not None:
            require_sync_callable(decoder, what="decoder", where="Consumer",
                                  alternative="msgpatterns.AsyncConsumer (its decoder may "
                                  "be an async def)")
        self._configure(
            "Consumer", broker=broker, handler=handler, topics=topics, group=group,
            retry=retry, ordered=ordered, max_in_flight=max_in_flight,
            ack_timeout=ack_timeout, decoder=decoder, dead_letters=dead_letters,
            poll_timeout=poll_timeout, shutdown_timeout=shutdown_timeout,
            fetch_batch=fetch_batch, name=name, default_name=f"msgpatterns-{group}",
            counts={"workers": workers}, log=log)
        check_batch("Consumer", batch=batch, ordered=ordered)
        self.handler: Callable[[Any], Any] = handler
        self.batch = batch
        guard = guard_of(handler, batch=batch)
        #: A RetryPolicy whose decide() is overridden sees every success too.
        self._plain_decide = type(retry).decide is RetryPolicy.decide if retry else True
        #: One message's run (the handler, after the decoder when there is one).
        self._call: Callable[[Any], Any] = \
            handler if decoder is None else self._decode_and_call
        #: The hot-path switch (:meth:`_choose_paths`): how a worker runs one message.
        self._run_message: Callable[[Message], None] = self._run_observed
        self._unwatch: Callable[[], None] | None = None
        self.workers = workers

        self._threads: list[threading.Thread] = []
        self._stop_requested = threading.Event()
        self._stopping = threading.Lock()  # one stop() at a time finishes the stop
        # The wheel (the ack deadlines and the retry timers on it) is made per start()
        # and stopped by stop(): a stopped consumer leaves no timer thread behind.
        self._wheel = self._new_wheel()
        self._deadlines: DeadlineTracker[Message] | None = None
        self._lanes: OrderedExecutor | None = None
        self._gate: KeyGate | None = None
        #: Fetching, flow control, the ready queue, the slots and the retry scheduler.
        self._fetcher = Fetcher(
            broker=broker, topics=self.topics, group=group, max_in_flight=max_in_flight,
            fetch_batch=fetch_batch, poll_timeout=self.poll_timeout, stats=self.stats,
            settler=self._settler, reporter=self._reporter,
            stop_requested=self._stop_requested, name=self.name, log=log)
        self._fetcher.lanes = workers  # ordered mode's batch refill (Fetcher.lanes)
        #: Where deliveries report their outcome (settler -> broker -> freed slot).
        self._settling = ThreadSettling(
            broker=broker, settler=self._settler, fetcher=self._fetcher,
            dead_letters=dead_letters, reporter=self._reporter, log=log)
        self._fetcher.sink = self._settler.rebind = self._settling.on_settled
        #: The batch claims of an @idempotent handler (None: plain, or one transaction
        #: per message).
        self._rounds = None if guard is None else ThreadRounds(
            guard, fetcher=self._fetcher, settling=self._settling, workers=workers,
            settle_unrun=self._settle_unrun, start_scope=self._start_scope,
            own_thread=self._own_thread, log=log)
        #: The batch runs (None: a plain per-message handler).
        self._batches = None if guard is None and not batch else ThreadBatches(
            handler=handler, batch=batch, rounds=self._rounds, fetcher=self._fetcher,
            settling=self._settling, decoder=decoder, fetch_batch=fetch_batch,
            workers=workers, settle_unrun=self._settle_unrun,
            start_scope=self._start_scope, own_thread=self._own_thread, log=log,
            name=self.name)

    @property
    def _state(self) -> _State:
        """The lifecycle state (kept by the fetcher, under its lock)."""
        return self._fetcher.state

    @_state.setter
    def _state(self, state: _State) -> None:
        self._fetcher.state = state

    @property
    def in_flight(self) -> int:
        """Messages fetched and not yet settled."""
        return len(self._fetcher.slots)

    def _new_wheel(self) -> TimingWheel:
        return TimingWheel(tick=0.01, slots=1024, name=f"{self.name}-timer")

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker threads and return. Raises
        :class:`~msgpatterns.errors.ClosedError` after :meth:`close`."""
        with self._fetcher.cond:
            self._check_open()
            if self._state is _State.RUNNING:
                return
            if self._state is _State.STOPPING:
                raise RuntimeError("the consumer is stopping")
            self._state = _State.RUNNING
            self._stop_requested.clear()
            self._wheel = self._new_wheel()
            self._deadlines = (
                DeadlineTracker(self._wheel, self.ack_timeout, self._deadline)
                if self.ack_timeout > 0 else None
            )
            self._gate = KeyGate() if self.ordered else None
            self._fetcher.reset(self._retry_clock(self._wheel, self._fetcher.until_idle),
                                self._gate)
            if self.ordered:
                # One thread fetches and admits; handlers run on the executor's lanes,
                # each key always on the lane that owns its logic partition.
                self._lanes = OrderedExecutor(self.workers, name=f"{self.name}-ordered")
                self._threads = [
                    threading.Thread(target=self._pump, name=f"{self.name}-pump", daemon=True)
                ]
            else:
                work = self._work if self._batches is None else self._batches.work
                self._threads = [
                    threading.Thread(
                        target=work, name=f"{self.name}-worker-{i}", daemon=True
                    )
                    for i in range(self.workers)
                ]
        self._settling.deadlines = self._deadlines
        if self._batches is not None:
            self._batches.deadlines = self._deadlines
        self._choose_paths()
        self._unwatch = _obs.watch_listener(self._choose_paths)
        if self._rounds is not None and not self.batch:
            self._rounds.start(f"{self.name}-claims")
        for thread in self._threads:
            thread.start()

    def _choose_paths(self) -> None:
        """The one hot-path switch, at start and whenever the telemetry listener
        changes: with no listener, a message runs without a telemetry scope; with no
        key gate, no overridden decide and no listener, a success is a plain broker
        ack and a freed slot (:meth:`ThreadSettling.choose`). Nothing per message
        tests it again."""
        self._settling.choose(plain_acks=self._gate is None and self._plain_decide)
        self._run_message = self._plain_run() if _obs.listener is None else self._run_observed

    def _own_thread(self) -> None:
        """Mark the calling thread as one of this consumer's (see :meth:`stop`)."""
        _own_thread.consumer = self

    def stop(self, timeout: float | timedelta | None = None) -> bool:
        """Stop fetching, let in-flight work finish for up to ``timeout`` seconds, then
        hand every message still unsettled back to the broker for redelivery.

        Guarantees, when it returns: no handler of this consumer runs again (a handler
        still running at the timeout is waited for; its outcome is ignored, its message
        was handed back); every message the consumer fetched - including what a fetch in
        progress at the call returns afterwards - is settled or handed back (nacked);
        every thread the consumer started (workers, pump, lanes, timer) has ended. The
        broker may be closed right after.

        Called from a handler (or any thread of this consumer) it cannot wait for
        itself: it requests the stop and returns False at once; ``run()`` and
        ``run_until_idle()`` then finish the stop, or call ``stop()`` again from
        outside to wait for it.

        Returns True when all in-flight work finished within the timeout.
        """
        limit = seconds(timeout)
        if getattr(_own_thread, "consumer", None) is self:
            self._request_stop()
            return False
        with self._stopping:  # a concurrent stop() returns only once this one is done
            return self._stop(limit)

    def _stop(self, limit: float | None) -> bool:
        with self._fetcher.cond:
            if self._state in (_State.NEW, _State.STOPPED):
                self._state = _State.STOPPED
                return True
            self._state = _State.STOPPING
            self._fetcher.wake()
            give_up = None if limit is None else time.monotonic() + limit
            while True:
                if self._fetcher.fetching:  # its messages are handed back; bounded by poll_timeout
                    self._fetcher.wait(self.poll_timeout)
                    continue
                if not self._fetcher.slots:
                    break
                left = None if give_up is None else give_up - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._fetcher.wait(left)
            leftovers = list(self._fetcher.slots.held)
            self._fetcher.ready.clear()
            self._fetcher.scheduler.clear()
        for message in leftovers:
            message.delivery.expire(message, Released("consumer stopped"))
        with self._fetcher.cond:
            self._state = _State.STOPPED
            self._fetcher.ready.clear()
            self._fetcher.wake()
            threads, self._threads = self._threads, []
            lanes, self._lanes = self._lanes, None
            unwatch, self._unwatch = self._unwatch, None
        current = threading.current_thread()
        for thread in threads:
            if thread is not current:
                thread.join()
        if lanes is not None:
            lanes.shutdown(wait=True)  # queued tasks of released messages run no handler
        if self._rounds is not None:  # no handler runs any more: it writes what is left
            self._rounds.stop()
        if unwatch is not None:
            unwatch()
        self._wheel.stop()
        self._stop_requested.set()
        return not leftovers

    def close(self) -> None:
        """Stop (``stop(shutdown_timeout)``), then close what the consumer owns; it never
        starts again: :meth:`start`, :meth:`run` and :meth:`run_until_idle` raise
        :class:`~msgpatterns.errors.ClosedError` afterwards. Idempotent; safe to call
        from any thread, also while another thread is in :meth:`run` (which then
        returns). Called from one of the consumer's own threads (a handler) it requests
        the stop and returns at once, as :meth:`stop` does.

        What the consumer owns is what it started: its worker, pump, lane and
        claim-writer threads and its timer, all ended by the stop. What it was given
        stays open - the broker, the checkers of an ``@idempotent`` handler, a
        ``dead_letters`` store - for whoever made them to close, after the consumer
        (``with broker, Consumer(broker, ...) as consumer:`` closes both, the consumer
        first)."""
        with self._fetcher.cond:
            self._closed = True  # from here on start() refuses
        self.stop(self.shutdown_timeout)

    def __enter__(self) -> Consumer:
        """Start the consumer (:meth:`start`); the ``with`` block's end closes it."""
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request_stop(self) -> None:
        """Ask for a stop without waiting (from a thread of this consumer)."""
        with self._fetcher.cond:
            if self._state is _State.RUNNING:
                self._state = _State.STOPPING
                self._fetcher.wake()
        self._stop_requested.set()

    def run(self) -> None:
        """Consume until SIGTERM, SIGINT or :meth:`stop`; then shut down gracefully."""
        restore: list[tuple[signal.Signals, Any]] = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                restore.append((sig, signal.getsignal(sig)))
                signal.signal(sig, self._on_signal)
        try:
            self.start()
            self._stop_requested.wait()
        finally:
            for sig, previous in restore:
                signal.signal(sig, previous)
            if self._state is not _State.STOPPED:
                self.stop(self.shutdown_timeout)

    def run_until_idle(self, timeout: float | timedelta | None = None) -> ConsumerStats:
        """Process until nothing is deliverable, in flight or waiting for a retry.

        On a broker with virtual time (the in-memory fake) the clock jumps to the next
        due delivery or held retry whenever nothing can run, instead of sleeping. Raises
        ``TimeoutError`` if not idle within ``timeout`` seconds of wall time (the
        consumer is then stopped; unsettled messages go back to the broker). A
        :meth:`stop` from a handler ends it early (in-flight work finishes first).
        """
        limit = seconds(timeout)
        self._check_open()
        with self._fetcher.cond:
            self._fetcher.until_idle = True
        self.start()
        idle = self._stop_requested.wait(limit)
        with self._fetcher.cond:
            self._fetcher.until_idle = False
        if not idle:
            self.stop(0)
            raise TimeoutError(f"{self.name} not idle after {limit}s: {self.stats}")
        self.stop(self.shutdown_timeout)
        return self.stats

    def _on_signal(self, signum: int, frame: object) -> None:
        log.info("%s: signal %s, shutting down", self.name, signum)
        self._stop_requested.set()

    # -- worker loop ----------------------------------------------------------------

    def _work(self) -> None:
        """Worker loop of a per-message handler: each message through the run the
        hot-path switch chose (:meth:`_plain_run`, or :meth:`_run_observed`)."""
        _own_thread.consumer = self
        next_message = self._fetcher.next
        popleft = self._fetcher.ready.popleft  # the queue is never replaced
        message: Message
        while True:
            try:  # Fetcher.next's own first step, without its frame: the common case
                message = popleft()  # type: ignore[assignment]  # no Claimed here
            except IndexError:
                item = next_message()
                if item is None:
                    return
                message = item  # type: ignore[assignment]  # no Claimed here
            try:
                self._run_message(message)
            except BaseException:  # the worker survives whatever happens
                log.exception("%s: running message %s failed", self.name,
                              escape_control(message.id), extra=self._log_extra(message))

    def _pump(self) -> None:
        """Ordered mode: admit each message past its key's gate onto the key's lane."""
        _own_thread.consumer = self
        gate, lanes, batches = self._gate, self._lanes, self._batches
        assert gate is not None and lanes is not None
        try:
            while True:
                message: Message | None = self._fetcher.next()  # type: ignore[assignment]
                if message is None:
                    return
                if batches is not None:  # claim what is admitted now, as one batch
                    admitted = [m for m in batches.take_ready(message, self.fetch_batch)
                                if gate.admit(m)]
                    if admitted:
                        batches.round_safely(admitted, lanes)
                elif gate.admit(message):
                    lanes.submit(ordering_key(message), self._execute_on_lane, message)
        finally:
            lanes.shutdown(wait=False)

    def _execute_on_lane(self, message: Message) -> None:
        _own_thread.consumer = self
        try:
            self._run_message(message)
        except BaseException:  # the lane survives whatever happens
            log.exception("%s: running message %s failed", self.name,
                          escape_control(message.id), extra=self._log_extra(message))

    # -- one delivery ---------------------------------------------------------------

    def _plain_run(self) -> Callable[[Message], None]:
        """The hot path, with no telemetry listener: run one message's handler and
        settle its outcome (its twin, :meth:`_run_observed`, only adds the scope). Made
        when the switch chooses it, with the run's parts bound."""
        call = self._call
        deadlines = self._deadlines
        track = None if deadlines is None else deadlines.track
        fetcher, running, moot = self._fetcher, _State.RUNNING, self._moot

        def run_plain(message: Message) -> None:
            delivery = message.delivery
            if delivery.settled:
                return  # handed back by stop() before it could run
            if fetcher.state is not running and moot(message):
                return
            if track is not None:
                track(message)
            error: BaseException | None = None
            try:
                call(message)
            except BaseException as exc:  # SystemExit & co fail the message, not the worker
                error = exc
            delivery.finish(message, error)

        return run_plain

    def _run_observed(self, message: Message) -> None:
        """The plain run inside the telemetry listener's delivery scope (when a
        listener is installed: the switch chooses it then)."""
        delivery = message.delivery
        if delivery.settled:
            return  # handed back by stop() before it could run
        if self._fetcher.state is not _State.RUNNING and self._moot(message):
            return
        deadlines = self._deadlines
        if deadlines is not None:
            deadlines.track(message)
        listener = _obs.listener
        scope = None if listener is None else self._start_scope(listener, message)
        error: BaseException | None = None
        try:
            self._call(message)
        except BaseException as exc:  # SystemExit & co fail the message, not the worker
            error = exc
        self._finish_in(scope, message, error)

    @staticmethod
    def _finish_in(scope: DeliveryScope | None, message: Message,
                   error: BaseException | None) -> None:
        """Settle ``message`` with its run's outcome inside its telemetry ``scope`` (the
        settlement runs in the delivery's trace context), then close the scope."""
        if scope is None:
            message.delivery.finish(message, error)
            return
        _obs.report(scope.handler_returned, error)
        try:
            message.delivery.finish(message, error)
        finally:
            _obs.report(scope.close)

    def _moot(self, message: Message) -> bool:
        """While stopping: a message whose broker is closed is handed back instead of
        run (its ack could not go out: running it would only apply its effect once more
        on redelivery; ``close()`` hands back what it left pending). True if so."""
        if getattr(self.broker, "closed", False) is not True:  # (a method: not a flag)
            return False
        message.delivery.expire(message, Released("broker closed while stopping"))
        return True

    def _decode_and_call(self, message: Message) -> None:
        """The handler after the decoder (a decoder error is a MalformedMessage)."""
        assert self.decoder is not None
        try:
            message.body = self.decoder(message.raw_body)
        except Exception as exc:
            raise MalformedMessage(f"cannot decode body: {describe(exc)}") from exc
        self.handler(message)

    def _settle_unrun(self, message: Message, error: BaseException | None) -> None:
        """Settle a message whose handler does not run (a duplicate: success; a key in
        progress, a missing key, a malformed body: ``error``), observed like a run."""
        listener = _obs.listener
        self._finish_in(None if listener is None else self._start_scope(listener, message),
                        message, error)

    # -- telemetry, health and log context (no cost while no listener is installed) --

    def _log_extra(self, message: Message) -> dict[str, Any]:
        """The ``extra`` fields of every log line about ``message``."""
        return self._settler.extra(message)

    def health(self) -> Health:
        """A snapshot of this consumer's health (cheap: no broker call unless the
        broker has a ``connected`` property). Safe from any thread."""
        with self._fetcher.cond:
            state = self._state
            in_flight = len(self._fetcher.slots)
            held_since = list(self._fetcher.slots.held.values())
            last = self._fetcher.last_fetch
        return health_snapshot(name=self.name, state=state,
                               alive=all(t.is_alive() for t in self._threads),
                               held_since=held_since, in_flight=in_flight, last_fetch=last,
                               broker=self.broker)


#: Former private helpers, kept for code that imported them.
_duration = _options_duration
_topic_list = topic_list
