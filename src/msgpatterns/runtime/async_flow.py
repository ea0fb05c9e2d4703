"""The asyncio driver's flow: the slots, the ready queue its workers pull from, the
retry scheduler, and the wake-ups (of idle workers, of the fetch loop).

What :mod:`.fetcher` is to the thread driver, this is to
:class:`~msgpatterns.aio.AsyncConsumer`: fetched messages take a slot (:mod:`.flow`)
and, when they may run (ordered mode's key :mod:`.gate`), join the ready queue; a fixed
pool of long-lived worker coroutines takes them from there; a settlement frees the slot
(or hands it to a retry copy, run now or when the :mod:`.scheduler` says it is due).
Nothing here calls back into the consumer: the settling side calls :meth:`free`, the
scheduler calls :meth:`retry_due`, the workers call :meth:`next`.

Wake-ups cost one future per wait, not per message: a burst of settlements in one turn
of the event loop wakes the fetch loop once, and a worker that finds the ready queue
non-empty takes the next message without suspending.

Not thread-safe: everything runs on the consumer's event loop (a settlement from a
foreign thread is moved onto the loop first, see :mod:`.async_settling`).
"""

from __future__ import annotations

import asyncio
from collections import deque

from msgpatterns.message import Message
from msgpatterns.runtime.clock import Clock, VirtualClock
from msgpatterns.runtime.flow import Slots
from msgpatterns.runtime.gate import KeyGate
from msgpatterns.runtime.lifecycle import State
from msgpatterns.runtime.rounds import Claimed
from msgpatterns.runtime.scheduler import RetryScheduler
from msgpatterns.runtime.settler import Settled
from msgpatterns.runtime.stats import ConsumerStats

__all__ = ["AsyncFlow"]


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class AsyncFlow:
    """Slots, ready queue and wake-ups of one asyncio consumer run."""

    def __init__(self, stats: ConsumerStats, now: VirtualClock) -> None:
        self.stats = stats
        self.state = State.NEW
        self.loop: asyncio.AbstractEventLoop | None = None
        self.gate: KeyGate | None = None
        #: Delayed retries (made per :meth:`reset`: on the loop's timer, or virtual).
        self.scheduler: RetryScheduler[Message] = RetryScheduler(now, self.retry_due)
        self.slots = Slots(stats, None, self.scheduler)
        #: Messages that may run now, in the order they may run (and the claimed
        #: messages of a batch claim round, at the front).
        self.ready: deque[Message | Claimed] = deque()
        self._idle: deque[asyncio.Future[None]] = deque()  # workers waiting for work
        self._watchers: list[asyncio.Future[None]] = []  # waiting for any change
        self._dirty = False  # a change no watcher has seen yet
        #: A fetch is running (one at a time: the free slots are counted before it).
        self.fetching = False

    def reset(self, loop: asyncio.AbstractEventLoop, clock: Clock,
              gate: KeyGate | None) -> None:
        """A new run on ``loop``: retries wait on ``clock``; ``gate`` in ordered mode."""
        self.loop = loop
        self.gate = gate
        self.scheduler = RetryScheduler(clock, self.retry_due)
        self.slots = Slots(self.stats, gate, self.scheduler)
        self.ready.clear()
        self._idle.clear()
        self._watchers.clear()
        self._dirty = False
        self.fetching = False

    # -- in: fetched messages, retries now due -----------------------------------------

    def admit(self, messages: list[Message], *, taker: bool = False) -> None:
        """Fetched ``messages`` take a slot each; each runs now or waits behind its key.
        ``taker``: the caller is a worker that takes the first ready one itself (one
        idle worker fewer is woken)."""
        self.stats.fetched += len(messages)
        self.slots.take(messages)
        gate = self.gate
        if gate is None:
            self.ready.extend(messages)
        else:
            self.ready.extend(m for m in messages if gate.admit(m))
        self._wake_workers(1 if taker else 0)

    def push(self, message: Message) -> None:
        """``message`` may run now (a retry, the key's next message)."""
        self.ready.append(message)
        self._wake_workers()

    def push_claimed(self, items: list[Claimed]) -> None:
        """Claimed messages of a round run next, before anything else ready."""
        self.ready.extendleft(reversed(items))
        self._wake_workers()

    def retry_due(self, message: Message) -> None:
        """A retry's timer fired: it may run (unless cancelled, or the run is over)."""
        if self.scheduler.take(message) and self.state is not State.STOPPED:
            self.push(message)
        self.notify()

    # -- out: settled deliveries --------------------------------------------------------

    def free(self, message: Message, settled: Settled) -> bool:
        """``message`` is settled: free its slot, or give it to the retry copy (ready
        now, or scheduled); in ordered mode its key's next message may run. True when
        the delivery must be handed back instead (a retry copy made after the stop)."""
        stopped = self.state is State.STOPPED
        run, give_back = self.slots.free(message, settled, stopped=stopped)
        if run is not None and not stopped:
            self.push(run)
        self.notify()
        return give_back

    def free_acked(self, message: Message) -> None:
        """One successful delivery was acked (the hot path: no gate, no retry)."""
        self.slots.free_one_acked(message)
        self.notify()

    # -- waiting --------------------------------------------------------------------------

    async def next(self) -> Message | Claimed | None:
        """The next message to run, waiting while there is none; None once the run
        is stopped (the worker then ends)."""
        ready = self.ready
        while not ready:
            if self.state is State.STOPPED:
                return None
            assert self.loop is not None
            waiter = self.loop.create_future()
            self._idle.append(waiter)
            await waiter
        return ready.popleft()

    def _wake_workers(self, taken: int = 0) -> None:
        """Wake as many idle workers as there are ready messages (but ``taken``)."""
        idle = self._idle
        for _ in range(min(len(idle), len(self.ready) - taken)):
            _wake(idle.popleft())

    def wake_all(self) -> None:
        """Wake every idle worker (the run stopped: they end)."""
        while self._idle:
            _wake(self._idle.popleft())

    def notify(self) -> None:
        """Something changed (a slot freed, a retry came due, the state moved)."""
        watchers = self._watchers
        if watchers:
            for waiter in watchers:
                _wake(waiter)
            watchers.clear()
        else:
            self._dirty = True

    async def wait_change(self, timeout: float | None = None) -> None:
        """Wait until something changed since the last wait returned (at most
        ``timeout`` seconds)."""
        if self._dirty:
            self._dirty = False
            return
        loop = self.loop
        assert loop is not None
        waiter = loop.create_future()
        self._watchers.append(waiter)
        timer = None if timeout is None else loop.call_later(timeout, _wake, waiter)
        try:
            await waiter
        finally:
            if timer is not None:
                timer.cancel()
            if waiter in self._watchers:
                self._watchers.remove(waiter)
