"""Where the thread driver's deliveries report their outcome.

A delivery settled on any thread - the handler returned or raised, an explicit
``message.ack`` from a foreign thread, the ack deadline, a stop - reports
``(message, error)`` to :meth:`ThreadSettling.on_settled`. That runs the settler's
settlement with the thread broker (:func:`~msgpatterns.runtime.settler.run_sync`) and
frees the slot in the fetcher. Nothing here calls back into the consumer: the outcome
flows one way, delivery -> settling -> settler -> broker -> fetcher's slots.

Batches of successes (a batch handler, a batch claim) are acked together
(:attr:`ThreadSettling.ack_all`): one broker call where the broker acks many at once, one lock.

The hot path - a success is a plain ack and a freed slot, when no key gate, no
overridden ``RetryPolicy.decide`` and no telemetry listener must see it - is chosen
once, by :meth:`ThreadSettling.choose` when the consumer starts (and again when the
listener changes), never tested per message.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from msgpatterns.brokers.base import SupportsAckMany
from msgpatterns.deadletter import DeadLetterStore
from msgpatterns.deadlines import DeadlineTracker
from msgpatterns.delivery import Delivery
from msgpatterns.message import Message
from msgpatterns.observability import stats as _obs
from msgpatterns.runtime.fetcher import Fetcher
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
        #: How a success is carried out, and how many are (see :meth:`choose`).
        self._succeeded: Callable[[Message], None] = self._settle_success
        #: Settle successful deliveries together (see :meth:`choose`): each one as
        #: :meth:`Delivery.finish` would (those settled already, or awaiting their
        #: handler's explicit ack, are left alone).
        self.ack_all: Callable[[Sequence[Message]], None] = self._finish_each

    def choose(self, *, plain_acks: bool) -> bool:
        """Pick the hot path or its plain twin (at start, and when the telemetry
        listener changes): with ``plain_acks`` (no key gate, no overridden decide) and
        no listener, a success is a broker ack and a freed slot, and :attr:`ack_all`
        acks many in one broker call; otherwise every success goes through the settler
        and is reported. Returns True for the hot path."""
        fast = plain_acks and _obs.listener is None
        self._succeeded = self._ack_one if fast else self._settle_success
        self.ack_all = self._ack_all_quietly if fast else self._finish_each
        return fast

    def on_settled(self, message: Message, error: BaseException | None) -> None:
        """A delivery was settled (once, on whichever thread settled it): carry the
        outcome out. Whatever fails, the delivery is settled another way and the slot
        is always freed."""
        deadlines = self.deadlines
        if deadlines is not None:
            deadlines.forget(message, None)
        if error is None:
            self._succeeded(message)
        else:
            self._settle(message, error)

    def _settle_success(self, message: Message) -> None:
        self._settle(message, None)

    def _settle(self, message: Message, error: BaseException | None) -> None:
        settled = Settled(["broker_errors"])
        try:
            settled = run_sync(self.settler.settle(message, error), self.broker,
                               self.dead_letters)
        finally:
            self.reporter.settled(message, settled.counted, error)  # before the slot
            self.fetcher.free(message, settled)

    def _ack_one(self, message: Message) -> None:
        """The hot path: a success is an ack and a freed slot."""
        try:
            self.broker.ack(message)
        except Exception as failure:
            self._ack_failed(message, failure)
            return
        self.fetcher.free_one_acked(message)

    @staticmethod
    def _finish_each(messages: Sequence[Message]) -> None:
        """Each success through its delivery's usual settlement (where a settlement
        must be seen per message: a telemetry listener, ordered mode's key gate, a
        RetryPolicy that overrides decide)."""
        for message in messages:
            message.delivery.finish(message, None)

    def _ack_all_quietly(self, messages: Sequence[Message]) -> None:
        """The hot path of many successes: one broker call (where the broker acks many
        at once), one lock and one stats update for all of them."""
        if not messages:
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
        """The ack of a success raised: settle it another way, count, report, free the
        slot."""
        settled = Settled(["broker_errors"])
        try:
            settled = run_sync(self.settler.ack_failed(message, failure), self.broker,
                               self.dead_letters)
        finally:
            self.reporter.settled(message, settled.counted, None)  # before the slot
            self.fetcher.free(message, settled)
