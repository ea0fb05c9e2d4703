"""The engine shared by :class:`BatchExecutor`, :class:`Flusher` and
:class:`MultipleQueueFlusher`, and by their async twins in :mod:`msgpatterns.aio`.

Three layers:

* a :class:`BatchPolicy` says what makes a helper a Flusher, an executor or a
  multiple-queue flusher: how many channels, which channel an item goes to, how long a
  batch may wait to fill up (``max_wait``) and what the processor receives;
* :class:`BatchState` holds every decision and all the bookkeeping - capacity, which
  batch goes out next (:func:`plan`), deadlines, flush and close marks, who to wake,
  counters, what happens after a processor call (log, ``on_error``, acks). Its
  operations are *steps* (generators) that never block: they yield a :class:`Wait`
  ("wait on condition n for up to t seconds") and end with :class:`Done`;
* a driver runs the steps under its lock and performs the waits: :class:`BatchQueue`
  on worker threads and ``threading.Condition``, the async helpers of
  :mod:`msgpatterns.aio.batching` on tasks and ``asyncio.Condition``. Only how they
  wait and how they call the processor differ.

Guarantees, for every helper and both drivers:

* Capacity is exact: a channel holds at most its capacity of items that were accepted
  and are not processed yet (queued, or in a batch the processor is working on).
* A batch goes out as soon as a worker is free and its channel has ``batch_size``
  items, or its oldest item has waited ``max_wait``, or a flush or close asks for it.
* A processor exception - any ``BaseException``, ``SystemExit`` and
  ``KeyboardInterrupt`` included - is logged, counted and passed to ``on_error``; the
  worker goes on with the next batch. With ``ack_messages`` the batch's messages are
  acked with the exception, so the consumer's retry policy redelivers them.
* ``add`` after ``close`` raises :class:`~msgpatterns.errors.QueueClosed`, and
  ``close`` processes every item accepted before it.
* Misuse is refused before anything runs: sizes that are not positive ints and
  negative durations raise :class:`~msgpatterns.errors.ConfigurationError` naming the
  argument; a processor of the wrong kind (``async def`` for a thread driver, a plain
  function for the async one) raises ``TypeError`` at construction; with
  ``ack_messages`` an item that is not a :class:`~msgpatterns.Message` raises
  ``TypeError`` at ``add``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from time import monotonic, perf_counter
from types import TracebackType
from typing import Any, Generic, NamedTuple, Protocol, Self, TypeVar

from msgpatterns._callables import require_sync_callable
from msgpatterns.batching.acks import settle_messages
from msgpatterns.errors import ConfigurationError, QueueClosed, seconds
from msgpatterns.message import Message
from msgpatterns.observability import stats as _obs

__all__ = [
    "DONE", "SPACE", "WORK", "BatchCounters", "BatchDriver", "BatchPolicy", "BatchQueue",
    "BatchState",
    "Channel", "Done", "ErrorHook", "Job", "ListPolicy", "Marks", "Notifier", "Steps", "Wait",
    "count", "duration", "plan",
]

log = logging.getLogger("msgpatterns.batching")

T = TypeVar("T")
B = TypeVar("B")
R = TypeVar("R")
N = TypeVar("N", bound="Notifier")

#: ``on_error(exception, batch)``: called after a processor call raised (any
#: ``BaseException``: a ``SystemExit`` from a processor fails its batch, not the worker).
ErrorHook = Callable[[BaseException, B], object]


def count(name: str, value: object) -> int:
    """``value`` as a size or count: an int of at least 1 (not a bool), else
    :class:`ConfigurationError` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be an int of at least 1, got {value!r}")
    return value


def duration(name: str, value: float | timedelta | None) -> float | None:
    """:func:`~msgpatterns.errors.seconds` whose error names the argument ``name``."""
    try:
        return seconds(value)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{name}: {exc}") from None


@dataclass(frozen=True, slots=True)
class BatchCounters:
    """A consistent snapshot of what a batching helper did so far.

    Attributes:
        items: items accepted by ``add``.
        processed: items that went through the processor (whether it raised or not).
        batches: processor calls.
        rejected: ``add`` calls that returned False because the queue stayed full.
        errors: processor calls that raised.
        depth: items accepted and not processed yet (queued or in a running batch);
            never more than the capacity.
    """

    items: int
    processed: int
    batches: int
    rejected: int
    errors: int
    depth: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class BatchPolicy(Generic[T, B]):
    """What makes a helper what it is; the drivers ask it, never the other way round.

    The defaults are one channel and no waiting (``max_wait`` 0); :meth:`batch` is for
    each policy to say.
    """

    #: Number of channels (independent queues, each with its own capacity).
    channels: int = 1
    #: Longest the oldest queued item of a channel waits for its batch to fill (seconds).
    max_wait: float = 0.0

    def channel_of(self, item: T, name: str) -> int:
        """The channel ``item`` goes to; raising here refuses the item."""
        return 0

    def batch(self, index: int, items: list[T]) -> B:
        """What the processor receives for ``items`` taken from channel ``index``."""
        raise NotImplementedError


class ListPolicy(BatchPolicy[T, list[T]]):
    """One channel, no waiting, the items as a list: :class:`BatchExecutor`'s policy
    and the base of :class:`Flusher`'s."""

    def batch(self, index: int, items: list[T]) -> list[T]:
        return items


class Channel(Generic[T]):
    """One FIFO queue with its own capacity. Guarded by the owner's lock."""

    __slots__ = (
        "capacity", "enqueued", "flush_mark", "held", "index", "items", "running",
        "stamps", "taken",
    )

    def __init__(self, index: int, capacity: int) -> None:
        self.index = index
        self.capacity = capacity
        self.items: deque[T] = deque()
        self.stamps: deque[float] = deque()  # the time each queued item arrived
        self.enqueued = 0  # items ever accepted; an item's sequence number is its rank
        self.taken = 0  # items ever handed to a worker
        self.held = 0  # accepted and not processed yet
        self.running: set[int] = set()  # first sequence number of each running batch
        self.flush_mark = 0  # items numbered below this must go out now

    def done_through(self) -> int:
        """Every item numbered below this has been processed."""
        return min(self.running) if self.running else self.taken

    def take(self, limit: int) -> tuple[int, list[T]]:
        """Remove up to ``limit`` items from the head; returns (first number, items)."""
        start = self.taken
        items = self.items
        if len(items) <= limit:
            batch = list(items)
            items.clear()
            self.stamps.clear()
        else:
            batch = [items.popleft() for _ in range(limit)]
            stamps = self.stamps
            for _ in range(limit):
                stamps.popleft()
        self.taken += len(batch)
        self.running.add(start)
        return start, batch


def plan(
    channels: Sequence[Channel[Any]],
    now: float,
    batch_size: int,
    max_wait: float,
    draining: bool,
) -> tuple[Channel[Any] | None, float | None]:
    """Decide what a free worker does at ``now``.

    Returns ``(channel, None)`` when ``channel`` has a batch due now: it is full, its
    oldest item has waited ``max_wait``, a flush covers its head, or the helper is
    draining; among several, the one whose oldest item is oldest. Otherwise returns
    ``(None, wake_at)``: the earliest time a batch becomes due, or None if every
    channel is empty.
    """
    best: Channel[Any] | None = None
    wake_at: float | None = None
    for channel in channels:
        if not channel.items:
            continue
        oldest = channel.stamps[0]
        due = oldest + max_wait
        if (
            due <= now
            or len(channel.items) >= batch_size
            or channel.taken < channel.flush_mark
            or draining
        ):
            if best is None or oldest < best.stamps[0]:
                best = channel
        elif wake_at is None or due < wake_at:
            wake_at = due
    if best is not None:
        return best, None
    return None, wake_at


@dataclass(slots=True)
class Job(Generic[T, B]):
    """A batch taken by a worker: the items numbered ``start`` on of ``channel``,
    what the processor receives, and what is needed to settle it afterwards."""

    channel: Channel[T]
    start: int
    items: list[T]
    batch: B
    snapshot: tuple[T, ...]  # the items to ack (ack_messages), as they were taken
    started: float  # perf_counter() when an observability listener is installed


#: What a flush or a close waits for: each channel and the count of items accepted
#: before it (all of them must be processed).
Marks = list[tuple[Channel[Any], int]]

#: The conditions a driver provides, by index: workers waiting for a batch, flush and
#: close waiting for progress, then one per channel for producers waiting for room.
WORK, DONE, SPACE = 0, 1, 2


class Notifier(Protocol):
    """What :class:`BatchState` needs of a driver's condition (``threading.Condition``
    and ``asyncio.Condition`` both are one); called with the driver's lock held."""

    def notify(self, n: int = 1) -> None: ...

    def notify_all(self) -> None: ...


class Wait(NamedTuple):
    """A step asking the driver to wait on condition ``condition`` (an index: WORK,
    DONE, SPACE + channel) with its lock held, until notified or ``timeout`` seconds
    pass (None: until notified), then to go on with the steps."""

    condition: int
    timeout: float | None


@dataclass(frozen=True, slots=True)
class Done(Generic[R]):
    """The last step of an operation: its result."""

    value: R


#: An operation as steps: the driver runs it under its lock, performing each
#: :class:`Wait` (the only thing that differs between threads and asyncio) until
#: :class:`Done`.
Steps = Generator[Wait | Done[R], None, None]


def _report_count(name: str, what: str) -> None:
    listener = _obs.listener
    if listener is not None:
        _obs.report(listener.batch_counted, name, {what: 1})


class BatchState(Generic[T, B]):
    """Everything a batching helper decides, waits for and counts, for either driver.

    Not thread-safe and never blocks: the driver runs each operation under its own lock
    (a ``threading.Lock``, an ``asyncio.Lock``). :meth:`add`, :meth:`flush`,
    :meth:`close` and :meth:`next_job` are :data:`Steps`: they say when to wait and
    for what (:class:`Wait`) and the driver waits on its condition of that index, the
    rest - deadlines, re-checks, who to wake (through :attr:`notifiers`) - is here.
    ``where`` names the helper in error messages; ``clock`` is monotonic seconds.
    """

    def __init__(
        self,
        name: str,
        policy: BatchPolicy[T, B],
        *,
        where: str,
        batch_size: int,
        capacity: int,
        ack_messages: bool,
        on_error: ErrorHook[B] | None,
        clock: Callable[[], float] = monotonic,
    ) -> None:
        count("batch_size", batch_size)
        count("channels", policy.channels)
        count("queue_size", capacity)
        if capacity < batch_size:
            raise ConfigurationError(
                f"queue_size ({capacity}) must be at least batch_size ({batch_size}), "
                "otherwise a batch could never fill up"
            )
        if on_error is not None:
            require_sync_callable(on_error, what="on_error", where=where)
        self.name = name
        self.policy = policy
        self.batch_size = batch_size
        self.ack_messages = ack_messages
        self.on_error = on_error
        self.clock = clock
        self.channels: list[Channel[T]] = [Channel(i, capacity) for i in range(policy.channels)]
        #: The driver's conditions, indexed WORK, DONE, SPACE + channel (see :meth:`bind`).
        self.notifiers: Sequence[Notifier] = ()
        self.closed = False
        self.queued = 0  # items queued in all channels (not yet taken)
        self.idle = 0  # workers waiting with no deadline
        self.items = self.processed = self.batches = self.rejected = self.errors = 0

    def bind(self, make: Callable[[], N]) -> list[N]:
        """Create the driver's conditions with ``make`` (one per index: WORK, DONE,
        SPACE + each channel), use them to wake waiters, and return them."""
        conditions = [make() for _ in range(SPACE + len(self.channels))]
        self.notifiers = conditions
        return conditions

    # -- producers ------------------------------------------------------------------

    def add(self, item: T, timeout: float | timedelta | None) -> Steps[bool]:
        """``add(item, timeout)``: checks the item and routes it now (the policy's
        route is user code: call this before taking the lock), then the steps that
        accept it. See :meth:`BatchQueue.add` for the contract."""
        if self.ack_messages and not isinstance(item, Message):
            raise ConfigurationError(
                f"{self.name}: with ack_messages=True every item must be a Message, got "
                f"{type(item).__name__}; add the Message itself or turn ack_messages off"
            )
        channel = self.channels[self.policy.channel_of(item, self.name)]
        wait = None if timeout is None else duration("timeout", timeout)
        return self._add(channel, item, wait)

    def _add(self, channel: Channel[T], item: T, wait: float | None) -> Steps[bool]:
        self._refuse_if_closed("is closed; item not accepted")
        if channel.held >= channel.capacity:
            give_up = self.clock() + (wait or 0.0)
            while channel.held >= channel.capacity:  # re-checked after every wake-up
                left = give_up - self.clock()
                if left <= 0:
                    self.rejected += 1
                    _report_count(self.name, "rejected")
                    yield Done(False)
                    return
                yield Wait(SPACE + channel.index, left)
                self._refuse_if_closed("was closed while waiting for room")
            if channel.held + 1 < channel.capacity:
                self.notifiers[SPACE + channel.index].notify()  # more room: pass it on
        channel.items.append(item)
        channel.stamps.append(self.clock())
        channel.enqueued += 1
        channel.held += 1
        self.queued += 1
        self.items += 1
        queued = len(channel.items)
        # Wake a worker only when it changes what it would do: a channel became
        # non-empty while a worker sleeps with no deadline, or a batch is full.
        if (queued == 1 and self.idle) or queued == self.batch_size:
            self.notifiers[WORK].notify()
        yield Done(True)

    def added(self, accepted: bool) -> bool:
        """Report an accepted item to the observability listener (outside the lock);
        returns ``accepted``."""
        if accepted:
            _report_count(self.name, "items")
        return accepted

    def _refuse_if_closed(self, why: str) -> None:
        if self.closed:
            raise QueueClosed(f"{self.name} {why}")

    # -- flush and close ------------------------------------------------------------

    def flush(self, timeout: float | timedelta | None) -> Steps[bool]:
        """``flush(timeout)``: every item accepted so far goes out now; the steps wait
        until they are processed (True) or ``timeout`` passes (False)."""
        limit = duration("timeout", timeout)
        marks: Marks = [(channel, channel.enqueued) for channel in self.channels]
        for channel, mark in marks:
            channel.flush_mark = max(channel.flush_mark, mark)
        self.notifiers[WORK].notify_all()
        return self._until_processed(marks, limit)

    def close(self, timeout: float | timedelta | None) -> Steps[bool]:
        """``close(timeout)``: refuse new items (waking producers waiting for room to
        tell them), drain the rest; the steps wait as :meth:`flush` does."""
        limit = duration("timeout", timeout)
        if not self.closed:
            self.closed = True
            for notifier in self.notifiers:
                notifier.notify_all()
        marks: Marks = [(channel, channel.enqueued) for channel in self.channels]
        return self._until_processed(marks, limit)

    def _until_processed(self, marks: Marks, limit: float | None) -> Steps[bool]:
        give_up = None if limit is None else self.clock() + limit
        while any(channel.done_through() < mark for channel, mark in marks):
            left = None if give_up is None else give_up - self.clock()
            if left is not None and left <= 0:
                yield Done(False)
                return
            yield Wait(DONE, left)
        yield Done(True)

    # -- workers --------------------------------------------------------------------

    def next_job(self) -> Steps[Job[T, B] | None]:
        """A free worker's steps: wait until a batch is due (:func:`plan`) and take it;
        ``None`` once closed and drained (the worker ends)."""
        while True:
            now = self.clock()
            channel, wake_at = plan(self.channels, now, self.batch_size,
                                    self.policy.max_wait, self.closed)
            if channel is not None:
                yield Done(self._take(channel))
                return
            if self.closed:
                yield Done(None)
                return
            if wake_at is None:
                # A worker that never comes back (a cancelled task) leaves idle too
                # high: that only costs a needless notify.
                self.idle += 1
                yield Wait(WORK, None)
                self.idle -= 1
            else:
                yield Wait(WORK, wake_at - now)

    def _take(self, channel: Channel[T]) -> Job[T, B]:
        start, items = channel.take(self.batch_size)
        self.queued -= len(items)
        if self.queued:
            self.notifiers[WORK].notify()  # let an idle worker see what is left
        return Job(
            channel, start, items, self.policy.batch(channel.index, items),
            tuple(items) if self.ack_messages else (),
            perf_counter() if _obs.listener is not None else 0.0,
        )

    def settle(self, job: Job[T, B], error: BaseException | None) -> bool:
        """After the processor ran on ``job`` (``error``: what it raised, any
        ``BaseException``): log, ``on_error``, report and ack. Never raises; returns
        whether the batch failed. Called without the lock."""
        if error is not None:
            log.error(
                "%s: processor failed on a batch of %d item(s)%s",
                self.name, len(job.items),
                f" from channel {job.channel.index}" if len(self.channels) > 1 else "",
                exc_info=error,
            )
            if self.on_error is not None:
                try:
                    self.on_error(error, job.batch)
                except BaseException:  # the hook must not kill the worker
                    log.exception("%s: on_error hook failed", self.name)
        listener = _obs.listener
        if listener is not None:
            _obs.report(listener.batch_processed, self.name, len(job.items),
                        perf_counter() - job.started, error is not None)
        if self.ack_messages:
            settle_messages(job.snapshot, error)
        return error is not None

    def finish(self, job: Job[T, B], failed: bool) -> None:
        """With the lock held: account for a processed batch (its items leave the
        capacity) and wake the producers and flushes waiting on it."""
        channel = job.channel
        channel.held -= len(job.items)
        channel.running.discard(job.start)
        self.processed += len(job.items)
        self.batches += 1
        if failed:
            self.errors += 1
        self.notifiers[SPACE + channel.index].notify(len(job.items))
        self.notifiers[DONE].notify_all()

    def counters(self) -> BatchCounters:
        return BatchCounters(
            items=self.items,
            processed=self.processed,
            batches=self.batches,
            rejected=self.rejected,
            errors=self.errors,
            depth=sum(channel.held for channel in self.channels),
        )


class BatchDriver(Generic[T, B]):
    """What the thread and the asyncio driver share: the :class:`BatchState` built
    from the arguments (each checked), the processor check, ``closed`` and ``repr``.

    A driver sets :attr:`workers_argument` (how its worker count is named in errors),
    checks the processor in :meth:`_check_processor` and starts in :meth:`_setup`.
    """

    #: How the number of workers is called in this driver's constructors.
    workers_argument = "workers"

    def __init__(
        self,
        name: str,
        policy: BatchPolicy[T, B],
        *,
        processor: Callable[[B], Any],
        batch_size: int,
        capacity: int,
        workers: int,
        ack_messages: bool = False,
        on_error: ErrorHook[B] | None = None,
    ) -> None:
        count(self.workers_argument, workers)
        where = f"{type(self).__name__} {name!r}"
        self._state: BatchState[T, B] = BatchState(
            name, policy, where=where, batch_size=batch_size, capacity=capacity,
            ack_messages=ack_messages, on_error=on_error,
        )
        self._check_processor(processor, where)
        self.name = name
        self.batch_size = batch_size
        self._processor = processor
        self._workers = workers
        self._setup()

    def _check_processor(self, processor: Callable[[B], Any], where: str) -> None:
        raise NotImplementedError

    def _setup(self) -> None:
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        """True once the helper was closed."""
        return self._state.closed

    @property
    def _channels(self) -> list[Channel[T]]:
        return self._state.channels

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {'closed' if self.closed else 'open'}>"


class BatchQueue(BatchDriver[T, B]):
    """Bounded queues of items handed to ``processor`` in batches by worker threads:
    the thread driver of a :class:`BatchState` (it only waits on condition variables
    and calls the processor).

    The base of the three batching helpers; each passes its :class:`BatchPolicy`
    and its ``threads`` as ``workers``.
    """

    workers_argument = "threads"

    def _check_processor(self, processor: Callable[[B], Any], where: str) -> None:
        require_sync_callable(processor, what="processor", where=where,
                              alternative=f"msgpatterns.aio.Async{type(self).__name__}")

    def _setup(self) -> None:
        self._lock = threading.Lock()
        self._conditions = self._state.bind(lambda: threading.Condition(self._lock))
        self._threads = [
            threading.Thread(target=self._run, name=f"{self.name}-{i}", daemon=True)
            for i in range(self._workers)
        ]
        for thread in self._threads:
            thread.start()

    # -- public API -----------------------------------------------------------------

    def add(self, item: T, timeout: float | timedelta | None = None) -> bool:
        """Queue ``item``; True once it is accepted.

        When the queue is full: without ``timeout`` (or with 0) return False at once;
        with a timeout, wait up to that many seconds for room, then return False.
        Every accepted item is processed, even across :meth:`close`.

        Raises:
            QueueClosed: :meth:`close` was called (also while waiting for room).
            TypeError: ``ack_messages`` is on and ``item`` is not a
                :class:`~msgpatterns.Message` (it could never be acked).
            ConfigurationError: ``timeout`` is negative (or not a duration).
        """
        steps = self._state.add(item, timeout)
        with self._lock:
            accepted = self._run_steps(steps)
        return self._state.added(accepted)

    def flush(self, timeout: float | timedelta | None = None) -> bool:
        """Send out every item accepted before this call without waiting for its batch
        to fill up, and wait until they are processed (up to ``timeout`` seconds).

        Returns True when they all are. Calling it from the processor raises
        RuntimeError (it would wait for itself).
        """
        self._refuse_from_worker("flush")
        with self._lock:
            return self._run_steps(self._state.flush(timeout))

    def close(self, timeout: float | timedelta | None = None) -> bool:
        """Refuse new items, process every accepted one, then stop the workers.

        Returns True once all are processed. With ``timeout``, returns False if they
        are not processed after that many seconds; the workers then go on draining in
        the background (nothing is dropped) and a later ``close()`` waits again.
        Producers waiting for room get :class:`~msgpatterns.errors.QueueClosed`.
        """
        self._refuse_from_worker("close")
        with self._lock:
            finished = self._run_steps(self._state.close(timeout))
        if finished:
            for thread in self._threads:
                thread.join()
        return finished

    @property
    def counters(self) -> BatchCounters:
        """A consistent snapshot of the counters."""
        with self._lock:
            return self._state.counters()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the waiting ----------------------------------------------------------------

    def _run_steps(self, steps: Steps[R]) -> R:
        """With the lock held: run ``steps``, blocking on each :class:`Wait`."""
        for step in steps:
            if isinstance(step, Done):
                return step.value
            self._conditions[step.condition].wait(step.timeout)
        raise AssertionError("steps ended without a result")

    def _refuse_from_worker(self, what: str) -> None:
        if threading.current_thread() in self._threads:
            raise RuntimeError(f"{self.name}: {what}() from the processor would wait for itself")

    def _run(self) -> None:
        state = self._state
        while True:
            with self._lock:
                job = self._run_steps(state.next_job())
            if job is None:
                return
            failed = True
            try:
                failed = state.settle(job, self._call(job.batch))
            finally:  # even a BaseException must not leave the items counted as held
                with self._lock:
                    state.finish(job, failed)

    def _call(self, batch: B) -> BaseException | None:
        """Run the processor; what it raised, or None.

        Any ``BaseException`` fails the batch only: a worker thread has no caller to hand
        a ``SystemExit`` or ``KeyboardInterrupt`` to, and dying would strand the queue.
        """
        try:
            self._processor(batch)
        except BaseException as exc:  # see the docstring
            return exc
        return None
