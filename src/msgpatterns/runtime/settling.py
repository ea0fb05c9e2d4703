"""Where the thread driver's deliveries report their outcome.

A delivery settled on any thread - the handler returned or raised, an explicit
``message.ack`` from a foreign thread, the ack deadline, a stop - reports
``(message, error)`` to :meth:`ThreadSettling.on_settled`. That runs the settler's
settlement with the thread broker (:func:`~msgpatterns.runtime.settler.run_sync`) and
frees the slot in the fetcher. Nothing here calls back into the consumer: the outcome
flows one way, delivery -> settling -> settler -> broker -> fetcher's slots.

Batches of successes (a batch handler, a batch claim) are acked together
(:meth:`ack_all`): one broker call where the broker acks many at once, one lock.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from msgpatterns._escape import escape_control
from msgpatterns.brokers.base import SupportsAckMany
from msgpatterns.deadletter import DeadLetterStore
from msgpatterns.deadlines import DeadlineTracker
from msgpatterns.delivery import Delivery
from msgpatterns.idempotency.batch import BatchGuard, Entry
from msgpatterns.message import Message
from msgpatterns.observability import stats as _obs
from msgpatterns.runtime.fetcher import Fetcher
from msgpatterns.runtime.rounds import expired
from msgpatterns.runtime.settler import Settled, Settler, run_sync
from msgpatterns.runtime.stats import Reporter

__all__ = ["ThreadSettling"]


class ThreadSettling:
    """Carries out settlements for one thread-driven consumer."""

    def __init__(self, *, broker: Any, settler: Settler, fetcher: Fetcher,
                 dead_letters: DeadLetterStore | None, reporter: Reporter,
                 log: logging.Logger) -> None:
        self.broker = broker
        self.settler = settler
        self.fetcher = fetcher
        self.dead_letters = dead_letters
        self.reporter = reporter
        self.log = log
        self._ack_many = broker.ack_many if isinstance(broker, SupportsAckMany) else None
        #: The ack deadlines of the current run (set at start).
        self.deadlines: DeadlineTracker[Message] | None = None
        #: A success is a plain ack: no key gate to release, no custom decide (set at
        #: start).
        self.plain_acks = False

    def on_settled(self, message: Message, error: BaseException | None) -> None:
        """A delivery was settled (once, on whichever thread settled it): carry the
        outcome out. Whatever fails, the delivery is settled another way and the slot
        is always freed."""
        deadlines = self.deadlines
        if deadlines is not None:
            deadlines.forget(message, None)
        if error is None and self.plain_acks and _obs.listener is None:
            # The hot path: a success is an ack and a freed slot.
            try:
                self.broker.ack(message)
            except Exception as failure:
                self._ack_failed(message, failure)
                return
            self.fetcher.free_one_acked(message)
            return
        settled = Settled(["broker_errors"])
        try:
            settled = run_sync(self.settler.settle(message, error), self.broker,
                               self.dead_letters)
        finally:
            self.reporter.settled(message, settled.counted, error)  # before the slot
            self.fetcher.free(message, settled)

    def on_claimed_settled(self, guard: BatchGuard, entry: Entry, message: Message,
                           error: BaseException | None) -> None:
        """The sink of a batch-claimed delivery: whoever settles it (its run, an
        explicit ack, its deadline, a stop), its claim is finished first - completed on
        a success, released on a failure, except that its deadline or a stop leaves
        the claim of a handler still running to that run (:meth:`BatchGuard.settled`)
        - then it is settled as usual."""
        if entry.open:
            try:
                guard.settled(entry, error, expired=expired(error))
            except Exception:
                self.log.exception("%s: finishing the idempotency claim of %s failed",
                                   self.settler.name, escape_control(message.id),
                                   extra=self.settler.extra(message))
        self.on_settled(message, error)

    def ack_all(self, messages: Sequence[Message]) -> None:
        """Settle successful deliveries together, as :meth:`Delivery.finish` would one
        by one (those settled already, or awaiting their handler's explicit ack, are
        left alone): one broker call (where the
        broker acks many at once), one lock and one stats update for all of them. Where
        a settlement must be seen per message (a telemetry listener, ordered mode's key
        gate, a RetryPolicy that overrides decide) each goes through the usual
        per-message settlement instead."""
        if not messages:
            return
        if not self.plain_acks or _obs.listener is not None:
            for message in messages:
                message.delivery.finish(message, None)
            return
        won = Delivery.settle_all_quietly(messages)
        deadlines = self.deadlines
        if deadlines is not None:
            deadlines.untrack_all(won)
        acked = won
        ack_many = self._ack_many
        if ack_many is not None and len(won) > 1:
            try:
                ack_many(won)
            except Exception:  # one by one: each failure is settled on its own
                acked = self._ack_each(won)
        else:
            acked = self._ack_each(won)
        if acked:
            self.fetcher.free_acked(acked)

    def _ack_each(self, messages: list[Message]) -> list[Message]:
        """Ack each delivery; returns those acked (the others are settled otherwise)."""
        acked = []
        ack = self.broker.ack
        for message in messages:
            try:
                ack(message)
            except Exception as failure:
                self._ack_failed(message, failure)
            else:
                acked.append(message)
        return acked

    def _ack_failed(self, message: Message, failure: Exception) -> None:
        """The ack of a success raised: settle it another way, count, free the slot."""
        self.fetcher.free(message, run_sync(self.settler.ack_failed(message, failure),
                                            self.broker, self.dead_letters))
