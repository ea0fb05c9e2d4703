"""The thread driver of the claim rounds (:mod:`msgpatterns.runtime.rounds`).

It performs the operations the rounds ask for with threads: the claim round trip on
the worker that took the batch, the claimed messages shared out to every worker (or
to their keys' lanes in ordered mode), the handler run on whichever worker takes its
message, and the completions written by a writer thread of their own
(:meth:`ThreadRounds.start`) while the workers run the next handlers - a finished
message never waits for another handler, and a worker never waits for the store to
write its claim. Every decision is the rounds' own.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from msgpatterns._escape import escape_control
from msgpatterns.idempotency.batch import BatchGuard, Entry
from msgpatterns.message import Message
from msgpatterns.observability import stats as _obs
from msgpatterns.ordering.executor import OrderedExecutor
from msgpatterns.runtime.fetcher import Fetcher
from msgpatterns.runtime.gate import ordering_key
from msgpatterns.runtime.rounds import (
    AckAll,
    Bind,
    Claimed,
    ClaimRounds,
    Close,
    Fail,
    Pause,
    Prepare,
    Run,
    Settle,
    SettleUnrun,
    Share,
    StartScope,
    WakeWriter,
    Write,
    drive,
)
from msgpatterns.runtime.settling import ThreadSettling

__all__ = ["ThreadRounds"]

class ThreadRounds:
    """Performs the claim rounds of one thread-driven consumer.

    Args:
        guard: the ``@idempotent`` handler's batch guard.
        fetcher: the consumer's fetcher (its ready queue takes the claimed messages).
        settling: where settlements go.
        workers: the consumer's worker threads (one alone needs no wake-up).
        settle_unrun: settles a message whose handler does not run (observed as a run).
        start_scope: starts a telemetry scope for a run.
        own_thread: marks the calling thread as one of the consumer's.
        log: the consumer's logger.
    """

    def __init__(self, guard: BatchGuard, *, fetcher: Fetcher, settling: ThreadSettling,
                 workers: int, settle_unrun: Callable[[Message, BaseException | None], None],
                 start_scope: StartScope, own_thread: Callable[[], None],
                 log: logging.Logger) -> None:
        self.guard = guard
        #: The decisions (the writer is a thread of its own: it runs no handler).
        self.core = ClaimRounds(guard, writer_runs_handlers=False)
        self.fetcher = fetcher
        self.settling = settling
        self.workers = workers
        self.log = log
        #: Recent seconds per run of a handler (sizes the batch claims).
        self.pace = 0.0
        self._settle_unrun = settle_unrun
        self._start_scope = start_scope
        self._own_thread = own_thread
        self._name = settling.settler.name
        self._to_write = threading.Event()
        self._writer: threading.Thread | None = None
        self._writer_stop = False
        #: What carries out each operation of the rounds (returns its answer; a batch
        #: handler's run adds its call: :class:`~msgpatterns.runtime.thread_batches.ThreadBatches`).
        self.ops: dict[type[Any], Callable[[Any], Any]] = {
            Run: self._run, WakeWriter: self._wake, Write: self._write,
            AckAll: self._ack_all, Prepare: self._prepare, Bind: self._bind,
            Share: self._share, SettleUnrun: self._unrun, Fail: self._fail,
            Close: self._close, Settle: self._settle, Pause: self._pause,
        }

    # -- what the consumer asks -------------------------------------------------------

    def round(self, live: list[Message], lanes: OrderedExecutor | None = None) -> None:
        """One claim round for ``live`` (this worker runs the first handler, or all go
        to their keys' ``lanes``)."""
        drive(self.core.round(live, lanes), self.ops)

    def run(self, claimed: Claimed) -> None:
        """Run a claimed message a worker took from the ready queue
        (:meth:`ClaimRounds.run`, its steps taken one by one: most runs end with the
        claim queued, and nothing left to drive)."""
        core = self.core
        step = core.begin(claimed)
        if not isinstance(step, Run):
            drive(step, self.ops)
            return
        after = core.ran(claimed, self._run(step))
        if after is not None:
            drive(after, self.ops)

    def run_on_lane(self, claimed: Claimed) -> None:
        """Run a claimed message on its key's lane (ordered mode)."""
        self._own_thread()
        try:
            self.run(claimed)
        except BaseException:  # the lane survives whatever happens
            message = claimed.entry.message
            self.log.exception("%s: running message %s failed", self._name,
                               escape_control(message.id),
                               extra=self.settling.settler.extra(message))

    # -- the writer thread ------------------------------------------------------------

    def start(self, name: str) -> None:
        """Start the writer thread of the completions."""
        self._writer_stop = False
        self._writer = threading.Thread(target=self._write_claims, name=name, daemon=True)
        self._writer.start()

    def stop(self) -> None:
        """No handler runs any more: the writer writes what is left and ends."""
        writer, self._writer = self._writer, None
        if writer is None:
            return
        self._writer_stop = True
        self._to_write.set()
        if writer is not threading.current_thread():
            writer.join()

    def _write_claims(self) -> None:
        """Whenever handlers returned, complete their claims and ack their messages
        (:meth:`ClaimRounds.write_returned`). Ends after :meth:`stop`, once nothing is
        left to write."""
        self._own_thread()
        wake = self._to_write
        while True:
            wake.wait()
            wake.clear()
            try:
                drive(self.core.write_returned(), self.ops)
            except BaseException:  # the writer survives whatever happens
                self.log.exception("%s: completing idempotency claims failed", self._name)
            if self._writer_stop:
                return

    # -- the operations ---------------------------------------------------------------

    def _run(self, op: Run) -> BaseException | None:
        entry = op.entry
        message = entry.message
        listener = _obs.listener
        scope = None if listener is None else self._start_scope(listener, message)
        error: BaseException | None = None
        started = time.perf_counter()
        try:
            entry.result = self.guard.handler(message)
        except BaseException as exc:  # SystemExit & co fail the message, not the worker
            error = exc
        self.pace = 0.8 * self.pace + 0.2 * (time.perf_counter() - started)
        if scope is not None:
            _obs.report(scope.handler_returned, error)
            _obs.report(scope.close)
        return error

    def _wake(self, op: WakeWriter) -> None:
        self._to_write.set()  # the writer thread was idle

    def _write(self, op: Write) -> None:
        try:
            self.guard.finish(op.returned, op.raised)
        except Exception:  # a closed checker...: the effects happened; settle anyway
            self.log.exception("%s: writing %d idempotency claim(s) failed", self._name,
                               len(op.returned) + len(op.raised))

    def _ack_all(self, op: AckAll) -> None:
        try:
            self.settling.ack_all(op.messages)
        except Exception:  # the writer goes on writing what is queued
            self.log.exception("%s: acking %d messages failed", self._name,
                               len(op.messages))

    def _prepare(self, op: Prepare) -> list[Entry]:
        return self.guard.prepare(op.messages)

    def _bind(self, op: Bind) -> None:
        for entry in op.entries:
            entry.message.delivery.bind(partial(self._claimed_settled, entry))

    def _claimed_settled(self, entry: Entry, message: Message,
                         error: BaseException | None) -> None:
        """The sink of a claimed delivery (see :meth:`ClaimRounds.settled`)."""
        drive(self.core.settled(entry, message, error), self.ops)

    def _share(self, op: Share) -> None:
        lanes = op.lanes
        if lanes is not None:
            for claimed in op.claimed:
                lanes.submit(ordering_key(claimed.entry.message), self.run_on_lane, claimed)
            return
        fetcher = self.fetcher
        fetcher.ready.extendleft(reversed(op.claimed))
        if self.workers > 1 or not op.inline:
            with fetcher.cond:
                fetcher.wake()

    def _unrun(self, op: SettleUnrun) -> None:
        self._settle_unrun(op.message, op.error)

    def _fail(self, op: Fail) -> None:
        op.message.delivery.finish(op.message, op.error)

    def _close(self, op: Close) -> None:
        try:
            self.guard.settled(op.entry, op.error, expired=op.expired)
        except Exception:
            message = op.entry.message
            self.log.exception("%s: finishing the idempotency claim of %s failed",
                               self._name, escape_control(message.id),
                               extra=self.settling.settler.extra(message))

    def _settle(self, op: Settle) -> None:
        self.settling.on_settled(op.message, op.error)

    def _pause(self, op: Pause) -> None:
        time.sleep(0)  # let the workers run on: what returns meanwhile joins in
