"""The engine shared by :class:`BatchExecutor`, :class:`Flusher` and
:class:`MultipleQueueFlusher`: bounded queues, worker threads, flush, close, counters.

Every helper is a :class:`BatchQueue` with a policy: how many channels it has, which
channel an item goes to, how long a batch may wait to fill up (``max_wait``) and what
the processor receives. Guarantees, for all three:

* Capacity is exact: a channel holds at most its capacity of items that were accepted
  and are not processed yet (queued, or in a batch the processor is working on).
* A batch goes out as soon as a worker is free and its channel has ``batch_size``
  items, or its oldest item has waited ``max_wait``, or a flush or close asks for it.
* A processor exception is logged, counted and passed to ``on_error``; the worker goes
  on with the next batch. With ``ack_messages`` the batch's messages are acked with the
  exception, so the consumer's retry policy redelivers them.
* ``add`` after ``close`` raises :class:`~msgpatterns.errors.QueueClosed`, and
  ``close`` processes every item accepted before it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from time import monotonic
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

from msgpatterns.batching.acks import settle_messages
from msgpatterns.errors import ConfigurationError, QueueClosed, seconds

__all__ = ["BatchCounters", "BatchQueue", "Channel", "ErrorHook", "plan"]

log = logging.getLogger("msgpatterns.batching")

T = TypeVar("T")
B = TypeVar("B")

#: ``on_error(exception, batch)``: called after a processor call raised.
ErrorHook = Callable[[Exception, B], object]


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


class Channel(Generic[T]):
    """One FIFO queue with its own capacity. Guarded by the owner's lock."""

    __slots__ = (
        "capacity", "enqueued", "flush_mark", "held", "index", "items", "running",
        "space", "stamps", "taken",
    )

    def __init__(self, index: int, capacity: int, lock: threading.Lock) -> None:
        self.index = index
        self.capacity = capacity
        self.items: deque[T] = deque()
        self.stamps: deque[float] = deque()  # monotonic time each queued item arrived
        self.enqueued = 0  # items ever accepted; an item's sequence number is its rank
        self.taken = 0  # items ever handed to a worker
        self.held = 0  # accepted and not processed yet
        self.running: set[int] = set()  # first sequence number of each running batch
        self.flush_mark = 0  # items numbered below this must go out now
        self.space = threading.Condition(lock)  # producers waiting for capacity

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


class BatchQueue(Generic[T, B]):
    """Bounded queues of items handed to ``processor`` in batches by worker threads.

    The base of the three batching helpers; subclasses decide the channel of an item
    (:meth:`_channel_of`) and what the processor receives (:meth:`_batch`).
    """

    def __init__(
        self,
        name: str,
        *,
        processor: Callable[[B], object],
        batch_size: int,
        capacity: int,
        threads: int,
        max_wait: float,
        channels: int = 1,
        ack_messages: bool = False,
        on_error: ErrorHook[B] | None = None,
    ) -> None:
        if batch_size < 1:
            raise ConfigurationError(f"batch_size must be at least 1, got {batch_size}")
        if threads < 1:
            raise ConfigurationError(f"threads must be at least 1, got {threads}")
        if channels < 1:
            raise ConfigurationError(f"channels must be at least 1, got {channels}")
        if capacity < batch_size:
            raise ConfigurationError(
                f"queue_size ({capacity}) must be at least batch_size ({batch_size}), "
                "otherwise a batch could never fill up"
            )
        if not callable(processor):
            raise ConfigurationError(f"processor must be callable, got {processor!r}")
        self.name = name
        self.batch_size = batch_size
        self._processor = processor
        self._max_wait = max_wait
        self._ack_messages = ack_messages
        self._on_error = on_error
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # workers waiting for a batch
        self._done = threading.Condition(self._lock)  # flush/close waiting for progress
        self._channels: list[Channel[T]] = [
            Channel(i, capacity, self._lock) for i in range(channels)
        ]
        self._closed = False
        self._queued = 0
        self._untimed_waiters = 0
        self._items = self._processed = self._batches = self._rejected = self._errors = 0
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    # -- policy hooks ---------------------------------------------------------------

    def _channel_of(self, item: T) -> Channel[T]:
        """The channel ``item`` goes to; raising here refuses the item."""
        return self._channels[0]

    def _batch(self, index: int, items: list[T]) -> B:
        """What the processor receives for ``items`` taken from channel ``index``."""
        raise NotImplementedError

    # -- public API -----------------------------------------------------------------

    def add(self, item: T, timeout: float | timedelta | None = None) -> bool:
        """Queue ``item``; True once it is accepted.

        When the queue is full: without ``timeout`` (or with 0) return False at once;
        with a timeout, wait up to that many seconds for room, then return False.
        Every accepted item is processed, even across :meth:`close`.

        Raises:
            QueueClosed: :meth:`close` was called (also while waiting for room).
        """
        channel = self._channel_of(item)
        with self._lock:
            if self._closed:
                raise QueueClosed(f"{self.name} is closed; item not accepted")
            if channel.held >= channel.capacity and not self._wait_for_room(
                channel, None if timeout is None else seconds(timeout)
            ):
                self._rejected += 1
                return False
            channel.items.append(item)
            channel.stamps.append(monotonic())
            channel.enqueued += 1
            channel.held += 1
            self._queued += 1
            self._items += 1
            queued = len(channel.items)
            # Wake a worker only when it changes what it would do: a channel became
            # non-empty while a worker sleeps with no deadline, or a batch is full.
            if (queued == 1 and self._untimed_waiters) or queued == self.batch_size:
                self._work.notify()
        return True

    def flush(self, timeout: float | timedelta | None = None) -> bool:
        """Send out every item accepted before this call without waiting for its batch
        to fill up, and wait until they are processed (up to ``timeout`` seconds).

        Returns True when they all are. Calling it from the processor raises
        RuntimeError (it would wait for itself).
        """
        self._refuse_from_worker("flush")
        limit = seconds(timeout)
        with self._lock:
            marks = [(channel, channel.enqueued) for channel in self._channels]
            for channel, mark in marks:
                channel.flush_mark = max(channel.flush_mark, mark)
            self._work.notify_all()
            return self._wait_processed(marks, limit)

    def close(self, timeout: float | timedelta | None = None) -> bool:
        """Refuse new items, process every accepted one, then stop the workers.

        Returns True once all are processed. With ``timeout``, returns False if they
        are not processed after that many seconds; the workers then go on draining in
        the background (nothing is dropped) and a later ``close()`` waits again.
        Producers waiting for room get :class:`~msgpatterns.errors.QueueClosed`.
        """
        self._refuse_from_worker("close")
        limit = seconds(timeout)
        with self._lock:
            if not self._closed:
                self._closed = True
                self._work.notify_all()
                for channel in self._channels:
                    channel.space.notify_all()
            marks = [(channel, channel.enqueued) for channel in self._channels]
            finished = self._wait_processed(marks, limit)
        if finished:
            for thread in self._threads:
                thread.join()
        return finished

    @property
    def closed(self) -> bool:
        """True once :meth:`close` was called."""
        return self._closed

    @property
    def counters(self) -> BatchCounters:
        """A consistent snapshot of the counters."""
        with self._lock:
            return BatchCounters(
                items=self._items,
                processed=self._processed,
                batches=self._batches,
                rejected=self._rejected,
                errors=self._errors,
                depth=sum(channel.held for channel in self._channels),
            )

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} {self.name!r} {state}>"

    # -- producer side --------------------------------------------------------------

    def _wait_for_room(self, channel: Channel[T], wait: float | None) -> bool:
        """With the lock held: wait up to ``wait`` seconds until ``channel`` has room."""
        if not wait:
            return False
        give_up = monotonic() + wait
        while channel.held >= channel.capacity:
            left = give_up - monotonic()
            if left <= 0:
                return False
            channel.space.wait(left)
            if self._closed:
                raise QueueClosed(f"{self.name} was closed while waiting for room")
        if channel.held + 1 < channel.capacity:
            channel.space.notify()  # more room than this producer needs: pass it on
        return True

    def _wait_processed(self, marks: list[tuple[Channel[T], int]], limit: float | None) -> bool:
        """With the lock held: wait until every channel processed the items numbered
        below its mark, for up to ``limit`` seconds."""
        give_up = None if limit is None else monotonic() + limit
        while any(channel.done_through() < mark for channel, mark in marks):
            if give_up is None:
                self._done.wait()
                continue
            left = give_up - monotonic()
            if left <= 0:
                return False
            self._done.wait(left)
        return True

    def _refuse_from_worker(self, what: str) -> None:
        if threading.current_thread() in self._threads:
            raise RuntimeError(f"{self.name}: {what}() from the processor would wait for itself")

    # -- worker side ----------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                job = self._next_job()
            if job is None:
                return
            channel, start, items = job
            failed = True
            try:
                failed = self._process(channel.index, items)
            finally:  # even a BaseException must not leave the items counted as held
                with self._lock:
                    self._finish(channel, start, len(items), failed)

    def _next_job(self) -> tuple[Channel[T], int, list[T]] | None:
        """With the lock held: wait for the next due batch; None when closed and empty."""
        while True:
            now = monotonic()
            channel, wake_at = plan(
                self._channels, now, self.batch_size, self._max_wait, self._closed
            )
            if channel is not None:
                start, items = channel.take(self.batch_size)
                self._queued -= len(items)
                if self._queued:
                    self._work.notify()  # let an idle worker see what is left
                return channel, start, items
            if self._closed:
                return None
            if wake_at is None:
                self._untimed_waiters += 1
                try:
                    self._work.wait()
                finally:
                    self._untimed_waiters -= 1
            else:
                self._work.wait(wake_at - now)

    def _process(self, index: int, items: list[T]) -> bool:
        """Run the processor on one batch and settle its messages; True if it raised."""
        batch = self._batch(index, items)
        snapshot = tuple(items) if self._ack_messages else ()
        error: Exception | None = None
        try:
            self._processor(batch)
        except Exception as exc:
            error = exc
            log.error(
                "%s: processor failed on a batch of %d item(s)%s",
                self.name, len(items),
                f" from channel {index}" if len(self._channels) > 1 else "", exc_info=True,
            )
            if self._on_error is not None:
                try:
                    self._on_error(exc, batch)
                except Exception:
                    log.exception("%s: on_error hook failed", self.name)
        if self._ack_messages:
            settle_messages(snapshot, error)
        return error is not None

    def _finish(self, channel: Channel[T], start: int, count: int, failed: bool) -> None:
        """With the lock held: account for a processed batch and wake who waits on it."""
        channel.held -= count
        channel.running.discard(start)
        self._processed += count
        self._batches += 1
        if failed:
            self._errors += 1
        channel.space.notify(count)
        self._done.notify_all()
