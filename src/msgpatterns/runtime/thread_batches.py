"""The thread driver's batch runs: the batch claims of an ``@idempotent`` handler and
batch handlers (``Consumer(..., batch=True)``).

The worker threads of such a consumer take their messages in batches of ready ones
(:meth:`ThreadBatches.work`): a batch handler is called once per batch, an
``@idempotent`` per-message handler has the batch claimed in one round trip
(:class:`~msgpatterns.runtime.thread_rounds.ThreadRounds`) and the claimed messages
shared out to every worker. The decisions are the sans-I/O cores'
(:mod:`msgpatterns.runtime.rounds`, :func:`msgpatterns.runtime.batches.run_batch`),
shared with the asyncio driver (:mod:`msgpatterns.runtime.async_batches`); this module
only blocks where they ask.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from msgpatterns.deadlines import DeadlineTracker
from msgpatterns.errors import MalformedMessage, describe
from msgpatterns.message import Message
from msgpatterns.ordering.executor import OrderedExecutor
from msgpatterns.runtime.batches import run_batch
from msgpatterns.runtime.fetcher import Fetcher
from msgpatterns.runtime.rounds import AckAll, CallBatch, Claimed, Fail, StartScope, drive
from msgpatterns.runtime.settling import ThreadSettling
from msgpatterns.runtime.thread_rounds import ThreadRounds

__all__ = ["ThreadBatches"]


class ThreadBatches:
    """Runs the batches of one thread-driven consumer.

    Args:
        handler: the handler (a batch handler's ``handler(messages)`` when ``batch``).
        batch: it is a batch handler.
        rounds: the claim rounds when it is ``@idempotent`` on a lease checker.
        fetcher: the consumer's fetcher (its ready queue).
        settling: where settlements go.
        decoder: the consumer's decoder, or None.
        fetch_batch: the largest batch; ``workers``: the consumer's worker threads.
        settle_unrun: settles a message whose handler does not run (observed as a run).
        start_scope: starts a telemetry scope for a run.
        own_thread: marks the calling thread as one of the consumer's.
        log: the consumer's logger; ``name``: its name.
    """

    def __init__(self, *, handler: Callable[[Any], Any], batch: bool,
                 rounds: ThreadRounds | None, fetcher: Fetcher, settling: ThreadSettling,
                 decoder: Callable[[Any], Any] | None, fetch_batch: int, workers: int,
                 settle_unrun: Callable[[Message, BaseException | None], None],
                 start_scope: StartScope, own_thread: Callable[[], None],
                 log: logging.Logger, name: str) -> None:
        self.handler = handler
        self.batch = batch
        self.rounds = rounds
        self.fetcher = fetcher
        self.settling = settling
        self.decoder = decoder
        self.fetch_batch = fetch_batch
        self.workers = workers
        self.settle_unrun = settle_unrun
        self.start_scope = start_scope
        self.own_thread = own_thread
        self.log = log
        self.name = name
        #: The ack deadlines of the current run (set at start).
        self.deadlines: DeadlineTracker[Message] | None = None
        #: What carries out each operation of a batch handler's run.
        self.ops: dict[type[Any], Callable[[Any], Any]] = {
            Fail: self._fail, AckAll: self._ack_all,
            **({} if rounds is None else rounds.ops), CallBatch: self._call,
        }

    def work(self) -> None:
        """A worker's loop: claimed messages are run (their round is under way),
        ready ones taken as a batch - for the batch handler, or for a new claim round
        (claimed messages are shared out to every worker; each claim is completed as
        its handler returns)."""
        self.own_thread()
        fetcher, rounds = self.fetcher, self.rounds
        while True:
            item = fetcher.next()
            if item is None:
                return
            try:
                if isinstance(item, Claimed):
                    assert rounds is not None  # only batch claims queue them
                    rounds.run(item)
                elif self.batch:
                    self.run_batch(self.intake(self.take_ready(item, self.fetch_batch)))
                else:
                    self.round(self.take_ready(item, self.claim_limit()))
            except BaseException:  # the worker survives whatever happens
                self.log.exception("%s: running a batch failed", self.name)

    def claim_limit(self) -> int:
        """How many messages one batch claim takes: what was fetched (``fetch_batch``),
        at most what the workers run within half the lease at the handler's recent
        pace - so no claim waits in line until its lease runs out."""
        rounds = self.rounds
        if rounds is None or rounds.pace <= 0.0:
            return self.fetch_batch
        room = rounds.guard.checker.lease * 0.5 * self.workers / rounds.pace
        return max(1, min(self.fetch_batch, int(room)))

    def take_ready(self, first: Message, limit: int) -> list[Message]:
        """``first`` and more ready messages (not claimed ones), up to ``limit``."""
        chunk = [first]
        ready = self.fetcher.ready
        popleft = ready.popleft  # atomic: no lock needed
        claims = self.rounds is not None  # only batch claims queue non-messages
        append = chunk.append
        for _ in range(limit - 1):
            try:
                item = popleft()
            except IndexError:
                break
            if claims and not isinstance(item, Message):
                ready.appendleft(item)
                break
            append(item)  # type: ignore[arg-type]  # no claims without a guard
        return chunk

    def intake(self, messages: list[Message]) -> list[Message]:
        """Start the deadlines and decode; the messages left to run (not handed back,
        decodable; a malformed one is settled here)."""
        deadlines, decoder = self.deadlines, self.decoder
        if decoder is None:  # the common case: one pass, one clock read
            live = [m for m in messages if not m.delivery.settled]
            if deadlines is not None:
                deadlines.track_all(live)
            return live
        live = []
        for message in messages:
            if message.acked:
                continue  # handed back by stop() before it could run
            if deadlines is not None:
                deadlines.track(message)
            try:
                message.body = decoder(message.raw_body)
            except Exception as exc:
                error = MalformedMessage(f"cannot decode body: {describe(exc)}")
                error.__cause__ = exc
                self.settle_unrun(message, error)
                continue
            live.append(message)
        return live

    def round(self, messages: list[Message], lanes: OrderedExecutor | None = None) -> None:
        """An @idempotent per-message handler on a batch: one claim for all, each
        handler run (here, or on its key's lane), each claim completed as its handler
        returns, then its ack."""
        assert self.rounds is not None
        self.rounds.round(self.intake(messages), lanes)

    def round_safely(self, messages: list[Message], lanes: OrderedExecutor) -> None:
        """:meth:`round` for ordered mode's pump, which survives whatever happens."""
        try:
            self.round(messages, lanes)
        except BaseException:  # the pump survives whatever happens
            self.log.exception("%s: running a batch of %d messages failed", self.name,
                               len(messages))

    def run_batch(self, live: list[Message]) -> None:
        """One call of the batch handler on ``live`` (their claims made first when it is
        ``@idempotent``), each message then settled on its own
        (:func:`msgpatterns.runtime.batches.run_batch`)."""
        core = None if self.rounds is None else self.rounds.core
        drive(run_batch(core, live, start_scope=self.start_scope, log=self.log,
                        name=self.name), self.ops)

    # -- the operations of a batch handler's run ------------------------------------

    def _call(self, op: CallBatch) -> BaseException | None:
        handler = self.handler if self.rounds is None else self.rounds.guard.handler
        try:
            handler(op.messages)
        except BaseException as exc:  # SystemExit & co fail the batch, not the worker
            return exc
        return None

    def _fail(self, op: Fail) -> None:
        op.message.delivery.finish(op.message, op.error)

    def _ack_all(self, op: AckAll) -> None:
        self.settling.ack_all(op.messages)
