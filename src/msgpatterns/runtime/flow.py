"""Flow control: the slots of the messages a consumer holds, and what frees them.

A slot is taken when a message is fetched and freed when its delivery is finally
settled; a retry copy takes over its original's slot (and, in ordered mode, its key).
So never more than ``max_in_flight`` messages are held: waiting to run, running,
awaiting an explicit ack, waiting for a retry, or parked behind their key.

Not thread-safe by itself: the thread driver calls it under its lock, the asyncio
driver on its loop.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import repeat

from msgpatterns.message import Message
from msgpatterns.runtime.gate import KeyGate
from msgpatterns.runtime.scheduler import RetryScheduler
from msgpatterns.runtime.settler import Settled
from msgpatterns.runtime.stats import ConsumerStats

__all__ = ["Slots"]


class Slots:
    """The messages held (message -> when it was fetched, monotonic seconds)."""

    __slots__ = ("gate", "held", "scheduler", "settled", "stats")

    def __init__(self, stats: ConsumerStats, gate: KeyGate | None,
                 scheduler: RetryScheduler[Message]) -> None:
        self.stats = stats
        self.gate = gate
        self.scheduler = scheduler
        self.held: dict[Message, float] = {}
        #: How many settlements so far (lets a waiter see that something moved).
        self.settled = 0

    def __len__(self) -> int:
        return len(self.held)

    def take(self, messages: Iterable[Message]) -> None:
        """Fetched ``messages`` take a slot each."""
        self.held.update(dict.fromkeys(messages, time.monotonic()))

    def nothing_active(self) -> bool:
        """Every held message is parked behind its key or waiting for a retry: no
        handler or ack can change what becomes due."""
        parked = self.gate.parked if self.gate is not None else 0
        return len(self.held) == parked + len(self.scheduler)

    def free(self, message: Message, settled: Settled, *,
             stopped: bool) -> tuple[Message | None, bool]:
        """``message`` is settled: count it and free its slot, or give it to the retry
        copy (run now, or scheduled after ``settled.delay``). Returns the message to
        run now (the retry, or the key's next message in ordered mode) and whether the
        delivery must be handed back instead (a retry copy made after the stop)."""
        self.stats.add(settled.counted)
        since = self.held.pop(message, None)
        retry = settled.retry
        give_back = retry is not None and stopped
        run: Message | None = None
        if retry is not None and not give_back:
            self.held[retry] = time.monotonic() if since is None else since
            if self.gate is not None:
                self.gate.transfer(message, retry)
            if settled.delay > 0:
                self.scheduler.schedule(retry, settled.delay)
            else:
                run = retry
        elif self.gate is not None:
            run = self.gate.release(message)
        self.settled += 1
        return run, give_back

    def free_one_acked(self, message: Message) -> None:
        """One successful delivery was acked (the hot path of a per-message handler)."""
        self.held.pop(message, None)
        self.stats.acked += 1
        self.settled += 1

    def free_acked(self, messages: Sequence[Message]) -> None:
        """Successful deliveries were acked (the hot path: no gate, no retry)."""
        deque(map(self.held.pop, messages, repeat(None)), maxlen=0)  # C speed
        count = len(messages)
        self.stats.acked += count
        self.settled += count
