"""The consumer runtime: fetch -> handler -> ack / retry / dead letter, for any broker.

Guarantees:

* Flow control: never more than ``max_in_flight`` messages fetched and not yet settled
  (waiting to run, running, awaiting an explicit ack, or waiting for a local retry).
* Every delivery is settled exactly once, by the first of: the handler returning
  (auto ack), an explicit ``message.ack``, the handler raising, the ack deadline, or
  the consumer stopping. The outcome goes through :meth:`RetryPolicy.decide`.
* ``stop(timeout)`` stops fetching, lets in-flight work finish until ``timeout``, then
  hands every message still unsettled back to the broker: nothing is lost.
* In ordered mode a key's messages run one at a time in delivery order; a message
  being retried holds its key, so later messages of that key wait (other keys go on).
"""

from __future__ import annotations

import enum
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from datetime import timedelta
from functools import partial
from typing import Any

from msgpatterns import headers as h
from msgpatterns.brokers.base import Broker, SupportsVirtualTime
from msgpatterns.deadletter import DeadLetter, DeadLetterStore
from msgpatterns.deadlines import DeadlineTracker
from msgpatterns.errors import AckTimeout, MalformedMessage, NeedRetry, seconds
from msgpatterns.message import Message
from msgpatterns.ordering.executor import OrderedExecutor
from msgpatterns.retry import Action, RetryPolicy
from msgpatterns.timer import TimerHandle, TimingWheel

__all__ = ["Consumer", "ConsumerStats", "Handler"]

log = logging.getLogger("msgpatterns.consumer")

Handler = Callable[[Message], Any]


class _Released(Exception):
    """Internal: the consumer is stopping and hands the message back unprocessed."""


@dataclass
class ConsumerStats:
    """What the consumer did so far."""

    fetched: int = 0
    acked: int = 0
    failed: int = 0
    retried_locally: int = 0
    redelivered: int = 0
    dead_lettered: int = 0
    ack_timeouts: int = 0
    released: int = 0
    broker_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Consumer:
    """Runs ``handler`` for every message of ``topics`` in consumer ``group``.

    Args:
        broker: any :class:`~msgpatterns.brokers.base.Broker`.
        handler: ``handler(message)``; return to ack, raise to fail (see RetryPolicy).
        topics: topics (streams, queues) to consume.
        group: consumer group; each group receives every message once (at least).
        workers: handler threads.
        retry: the :class:`RetryPolicy` (default ``RetryPolicy()``).
        ordered: process each ``message.key`` serially in delivery order.
        max_in_flight: most messages held at once (fetched and not yet settled).
        ack_timeout: seconds a delivery may stay unsettled before it is failed.
        decoder: turns ``message.raw_body`` into ``message.body`` before the handler;
            a decoder error is a :class:`~msgpatterns.errors.MalformedMessage` and goes
            straight to the dead-letter store.
        dead_letters: a store for dead letters instead of the broker's own.
        poll_timeout: longest a fetch waits for new messages (bounds ``stop`` latency).
        shutdown_timeout: how long ``run()`` lets in-flight work finish on SIGTERM.
    """

    def __init__(
        self,
        broker: Broker,
        handler: Handler,
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
        poll_timeout: float = 0.25,
        shutdown_timeout: float = 30.0,
        fetch_batch: int = 64,
        name: str | None = None,
    ) -> None:
        if isinstance(topics, str):
            topics = [topics]
        if not topics:
            raise ValueError("Consumer needs at least one topic")
        if workers < 1 or max_in_flight < 1 or fetch_batch < 1:
            raise ValueError("workers, max_in_flight and fetch_batch must be at least 1")
        self.broker = broker
        self.handler = handler
        self.topics = list(topics)
        self.group = group
        self.workers = workers
        self.retry = retry if retry is not None else RetryPolicy()
        self.ordered = ordered
        self.max_in_flight = max_in_flight
        self.ack_timeout = seconds(ack_timeout) or 0.0
        self.decoder = decoder
        self.dead_letters = dead_letters
        self.poll_timeout = poll_timeout
        self.shutdown_timeout = shutdown_timeout
        self.fetch_batch = fetch_batch
        self.name = name or f"msgpatterns-{group}"
        self.handler_name = getattr(handler, "__qualname__", None) or repr(handler)
        self.stats = ConsumerStats()

        self._cond = threading.Condition(threading.Lock())
        self._ready: deque[Message] = deque()
        self._in_flight: set[Message] = set()
        self._retry_timers: dict[Message, TimerHandle] = {}
        self._held: dict[Message, float] = {}  # ordered delayed retries: due (broker clock)
        self._deadlines: DeadlineTracker[Message] | None = None
        self._fetching = False
        self._waiting = 0
        self._state = _State.NEW
        self._until_idle = False
        self._settled_count = 0
        self._threads: list[threading.Thread] = []
        self._stop_requested = threading.Event()
        self._wheel = TimingWheel(tick=0.01, slots=1024, name=f"{self.name}-timer")
        if self.ack_timeout > 0:
            self._deadlines = DeadlineTracker(self._wheel, self.ack_timeout, self._deadline)
        self._gate: _KeyGate | None = None
        self._lanes: OrderedExecutor | None = None

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker threads and return."""
        with self._cond:
            if self._state is _State.RUNNING:
                return
            if self._state is _State.STOPPING:
                raise RuntimeError("the consumer is stopping")
            self._state = _State.RUNNING
            self._stop_requested.clear()
            if self.ordered:
                # One thread fetches and admits; handlers run on the executor's lanes,
                # each key always on the lane that owns its logic partition.
                self._gate = _KeyGate()
                self._lanes = OrderedExecutor(self.workers, name=f"{self.name}-ordered")
                self._threads = [
                    threading.Thread(target=self._pump, name=f"{self.name}-pump", daemon=True)
                ]
            else:
                self._threads = [
                    threading.Thread(
                        target=self._work, name=f"{self.name}-worker-{i}", daemon=True
                    )
                    for i in range(self.workers)
                ]
        for thread in self._threads:
            thread.start()

    def stop(self, timeout: float | timedelta | None = None) -> bool:
        """Stop fetching, let in-flight work finish for up to ``timeout`` seconds, then
        hand every message still unsettled back to the broker for redelivery.

        Returns True when all in-flight work finished within the timeout.
        """
        limit = seconds(timeout)
        with self._cond:
            if self._state in (_State.NEW, _State.STOPPED):
                self._state = _State.STOPPED
                return True
            self._state = _State.STOPPING
            self._wake()
            give_up = None if limit is None else time.monotonic() + limit
            while self._in_flight:
                left = None if give_up is None else give_up - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._wait(left)
            leftovers = list(self._in_flight)
            self._ready.clear()
            self._held.clear()
        for message in leftovers:
            timer = self._retry_timers.pop(message, None)
            if timer is not None:
                timer.cancel()
            message.expire(_Released("consumer stopped"))
        with self._cond:
            self._state = _State.STOPPED
            self._wake()
            threads, self._threads = self._threads, []
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=0.2)
        self._stop_requested.set()
        return not leftovers

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
        due delivery instead of sleeping, and only while nothing is in flight. Raises
        ``TimeoutError`` if not idle within ``timeout`` seconds of wall time (the
        consumer is then stopped; unsettled messages go back to the broker).
        """
        limit = seconds(timeout)
        with self._cond:
            self._until_idle = True
        self.start()
        idle = self._stop_requested.wait(limit)
        with self._cond:
            self._until_idle = False
        if not idle:
            self.stop(0)
            raise TimeoutError(f"{self.name} not idle after {limit}s: {self.stats}")
        self.stop(0)
        return self.stats

    def _on_signal(self, signum: int, frame: object) -> None:
        log.info("%s: signal %s, shutting down", self.name, signum)
        self._stop_requested.set()

    @property
    def in_flight(self) -> int:
        """Messages fetched and not yet settled."""
        return len(self._in_flight)

    # -- worker loop ----------------------------------------------------------------

    def _wait(self, timeout: float | None = None) -> None:
        """Wait on the condition (lock held), counted so that wakes are skipped when
        nobody waits: settlement is the hot path."""
        self._waiting += 1
        try:
            self._cond.wait(timeout)
        finally:
            self._waiting -= 1

    def _wake(self) -> None:
        if self._waiting:
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            message = self._next()
            if message is None:
                return
            self._execute(message)

    def _pump(self) -> None:
        """Ordered mode: admit each message past its key's gate onto the key's lane."""
        gate, lanes = self._gate, self._lanes
        assert gate is not None and lanes is not None
        try:
            while True:
                message = self._next()
                if message is None:
                    return
                if gate.admit(message):
                    lanes.submit(_KeyGate.key(message), self._execute, message)
        finally:
            lanes.shutdown(wait=False)

    def _next(self) -> Message | None:
        """The next message to run, fetching when needed; None when the worker exits."""
        try:
            return self._ready.popleft()  # the common case needs no lock (deque is atomic)
        except IndexError:
            pass
        while True:
            with self._cond:
                while True:
                    if self._ready:
                        return self._ready.popleft()
                    if self._state is _State.STOPPED:
                        return None
                    if self._state is _State.STOPPING:
                        if not self._in_flight:
                            return None
                        self._wait()
                        continue
                    free = self.max_in_flight - len(self._in_flight)
                    if self._fetching:
                        self._wait(self.poll_timeout)
                        continue
                    if free <= 0:
                        if not (self._until_idle and self._nothing_active() and self._jump()):
                            self._wait(self.poll_timeout)
                        continue
                    self._fetching = True
                    until_idle = self._until_idle
                    generation = self._settled_count
                    break
            messages = self._fetch(min(free, self.fetch_batch), 0.0 if until_idle else None)
            with self._cond:
                self._fetching = False
                if messages:
                    for message in messages:
                        message.bind(self._on_settled)
                    self.stats.fetched += len(messages)
                    self._in_flight.update(messages)
                    self._ready.extend(messages[1:])
                    self._wake()
                    return messages[0]
                self._wake()
                if not until_idle or self._state is not _State.RUNNING or self._ready:
                    continue
                if not self._nothing_active():
                    if self._settled_count == generation:
                        self._wait(self.poll_timeout)
                elif not self._jump():
                    if self._in_flight:  # holds due later in real time
                        self._wait(self.poll_timeout)
                    else:
                        self._finish_idle()
                        return None

    def _nothing_active(self) -> bool:
        """Lock held: every in-flight message is parked behind its key or held for a
        delayed retry, so no handler or ack can change what becomes due."""
        parked = self._gate.parked if self._gate is not None else 0
        return len(self._in_flight) == parked + len(self._held)

    def _jump(self) -> bool:
        """Lock held, nothing active: move virtual time to the next due delivery or held
        retry and release the holds now due. False when nothing could move."""
        virtual = self.broker if isinstance(self.broker, SupportsVirtualTime) else None
        due = virtual.next_due(self.topics, self.group) if virtual is not None else None
        if self._held:
            first_hold = min(self._held.values())
            due = first_hold if due is None else min(due, first_hold)
        if due is None:
            return False
        if virtual is not None:
            virtual.advance_to(due)
        return self._release_due_holds() or virtual is not None

    def _release_due_holds(self) -> bool:
        now = self.broker.now()
        due = [m for m, at in self._held.items() if at <= now]
        for message in due:
            del self._held[message]
            timer = self._retry_timers.pop(message, None)
            if timer is not None:
                timer.cancel()
            self._ready.append(message)
        return bool(due)

    def _fetch(self, count: int, timeout: float | None) -> list[Message]:
        try:
            return self.broker.fetch(
                self.topics, self.group, max_messages=count,
                timeout=self.poll_timeout if timeout is None else timeout,
            )
        except Exception:
            with self._cond:
                self.stats.broker_errors += 1
            log.exception("%s: fetch failed; retrying", self.name)
            time.sleep(min(self.poll_timeout, 1.0))
            return []

    def _finish_idle(self) -> None:
        self._state = _State.STOPPING
        self._stop_requested.set()
        self._wake()

    # -- one delivery ---------------------------------------------------------------

    def _execute(self, message: Message) -> None:
        if self._deadlines is not None:
            self._deadlines.track(message)
        error: BaseException | None = None
        try:
            if self.decoder is not None:
                try:
                    message.body = self.decoder(message.raw_body)
                except Exception as exc:
                    raise MalformedMessage(f"cannot decode body: {exc!r}") from exc
            self.handler(message)
        except Exception as exc:
            error = exc
        message.handler_finished(error)

    def _deadline(self, message: Message) -> None:
        error = AckTimeout(
            f"message {message.id} not acked within {self.ack_timeout:g}s "
            f"by handler {self.handler_name}"
        )
        if message.expire(error):
            self.stats.ack_timeouts += 1
            log.warning("%s; failing the delivery", error)

    def _on_settled(self, message: Message, error: BaseException | None) -> None:
        """Act on a settled delivery; runs once, on whichever thread settled it."""
        if self._deadlines is not None:
            self._deadlines.untrack(message)
        retry: Message | None = None
        delay = 0.0
        hold = False
        counted: list[str] = []  # stats to add, under the lock, in _release
        try:
            if isinstance(error, _Released):
                counted.append("released")
                self.broker.nack(message, 0.0)
                return
            verdict = self.retry.decide(message, error)
            if verdict.action is Action.ACK:
                self.broker.ack(message)
                counted.append("acked")
                return
            assert error is not None
            counted.append("failed")
            self._log_failure(message, error, verdict.action, verdict.delay)
            delay = verdict.delay
            if verdict.action is Action.RETRY_LOCALLY:
                retry = message.copy_for_retry(local=True)
                counted.append("retried_locally")
            elif verdict.action is Action.REDELIVER:
                self._record_failure(message, error)
                counted.append("redelivered")
                if self._gate is not None:
                    # Ordered: the retry stays here and keeps its key; going back to the
                    # broker would let later messages of the key overtake it.
                    retry = message.copy_for_retry(attempt=message.attempt + 1)
                    retry.headers[h.ATTEMPT] = str(retry.attempt)
                    hold = True
                else:
                    self.broker.nack(message, delay)
            else:
                self._dead_letter(message, error, verdict.reason)
                counted.append("dead_lettered")
        except Exception:
            counted.append("broker_errors")
            log.exception(
                "%s: settling message %s failed; the broker will redeliver it",
                self.name, message.id,
            )
        finally:
            self._release(message, retry, delay, hold, counted)

    def _release(self, message: Message, retry: Message | None, delay: float,
                 hold: bool, counted: list[str]) -> None:
        """Lock-protected bookkeeping after a settlement: count it, free the slot, or
        put the retry copy in its place (now, after ``delay``, or held until due)."""
        with self._cond:
            stats = self.stats
            for name in counted:
                setattr(stats, name, getattr(stats, name) + 1)
            self._in_flight.discard(message)
            if retry is not None and self._state is _State.STOPPED:
                self.broker.nack(message, 0.0)  # stopped meanwhile: give it back
                retry = None
            if retry is not None:
                retry.bind(self._on_settled)
                self._in_flight.add(retry)
                if self._gate is not None:
                    self._gate.transfer(message, retry)
                if hold:
                    self._held[retry] = self.broker.now() + delay
                if delay > 0:
                    self._retry_timers[retry] = self._wheel.schedule(
                        delay, partial(self._requeue, retry)
                    )
                else:
                    self._held.pop(retry, None)
                    self._ready.appendleft(retry)
            elif self._gate is not None:
                following = self._gate.release(message)
                if following is not None:
                    self._ready.appendleft(following)
            self._settled_count += 1
            self._wake()

    def _requeue(self, message: Message) -> None:
        with self._cond:
            if self._retry_timers.pop(message, None) is None:
                return
            self._held.pop(message, None)
            self._ready.appendleft(message)
            self._wake()

    def _record_failure(self, message: Message, error: BaseException) -> None:
        """Keep the failure history in headers so it survives redelivery."""
        now = repr(self.broker.now())
        message.headers.setdefault(h.FIRST_FAILED_AT, now)
        message.headers[h.LAST_FAILED_AT] = now
        message.headers[h.ERROR_TYPE] = type(error).__name__
        message.headers[h.ERROR_MESSAGE] = str(error)[:500]

    def _dead_letter(self, message: Message, error: BaseException, reason: str) -> None:
        record = DeadLetter.from_error(
            message, error, now=self.broker.now(), reason=reason, group=self.group
        )
        log.error(
            "%s: message %s (key %r, topic %r) dead-lettered after %d attempt(s): %s",
            self.name, message.id, message.key, message.topic, message.attempt, reason,
        )
        if self.dead_letters is not None:
            self.dead_letters.put(record)
            self.broker.ack(message)
        else:
            self.broker.dead_letter(message, record)

    def _log_failure(self, message: Message, error: BaseException, action: Action,
                     delay: float) -> None:
        if isinstance(error, NeedRetry):
            log.debug("%s: message %s asked for a retry (%s)", self.name, message.id, error)
        elif action is not Action.DEAD_LETTER:
            log.warning(
                "%s: handler %s failed on message %s (attempt %d): %r; %s in %.3gs",
                self.name, self.handler_name, message.id, message.attempt, error,
                action.value, delay,
            )


class _KeyGate:
    """Ordered mode: one message per key at a time, in delivery order.

    A key is owned by one message from the moment it is admitted until it is finally
    settled (acked, dead-lettered or handed back); its retry copies inherit the
    ownership. Messages of an owned key wait in that key's backlog, in order.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: dict[str, Message] = {}
        self._backlog: dict[str, deque[Message]] = {}
        self.parked = 0  # messages waiting in backlogs

    @staticmethod
    def key(message: Message) -> str:
        """The ordering key: ``message.key``, or the message id when it has none."""
        return message.key if message.key is not None else message.id

    def admit(self, message: Message) -> bool:
        """True if ``message`` may run now; otherwise it joins its key's backlog."""
        key = self.key(message)
        with self._lock:
            owner = self._owner.get(key)
            if owner is None:
                self._owner[key] = message
                return True
            if owner is message:
                return True
            self._backlog.setdefault(key, deque()).append(message)
            self.parked += 1
            return False

    def transfer(self, old: Message, new: Message) -> None:
        """A retry copy takes over its key from the delivery it replaces."""
        key = self.key(old)
        with self._lock:
            if self._owner.get(key) is old:
                self._owner[key] = new

    def release(self, message: Message) -> Message | None:
        """``message`` is finally settled: the next message of its key, now admitted."""
        key = self.key(message)
        with self._lock:
            if self._owner.get(key) is not message:
                return None
            backlog = self._backlog.get(key)
            if not backlog:
                del self._owner[key]
                return None
            following = backlog.popleft()
            self.parked -= 1
            if not backlog:
                del self._backlog[key]
            self._owner[key] = following
            return following
