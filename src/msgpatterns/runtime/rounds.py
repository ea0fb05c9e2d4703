"""Batch claims of an ``@idempotent`` handler: the claim rounds, written once for both
drivers as a sans-I/O state machine.

A *round* is the messages of one batch claim: one ``claim_many`` round trip
(:meth:`BatchGuard.prepare`) for a batch of ready messages, then each claimed
message's handler, run one by one (on any worker, or on its key's lane). The rules,
fixed by issue 19 (hole 1):

* **Each claim is finished as its own handler ends**, never when the round's slowest
  handler ends: a handler that raised releases its claim itself; one that returned
  queues its claim in :class:`Completions` - a group commit: the claims of the
  handlers that returned meanwhile are completed together in one round trip.
* **DONE before ack**: a message is acked only after its completion returned.
* **A deadline or a stop never takes a running handler's claim**: the claim stays
  with that run (completed if it returns, released if it raises); a claim whose
  handler has not begun is released when its message is settled.
* A message whose key an earlier message of its round holds waits for the round
  (``Round.later``): once every claim of the round is finished it is claimed again
  (then a duplicate, or run if the first copy failed).

:class:`ClaimRounds` does no I/O, starts no thread and knows no event loop (the
shape of :mod:`msgpatterns.runtime.settler` and :mod:`msgpatterns.idempotency.guard`):
each procedure (:meth:`~ClaimRounds.round`, :meth:`~ClaimRounds.run`,
:meth:`~ClaimRounds.write_returned`, :meth:`~ClaimRounds.settled`) is a generator that
yields what it needs done - an *operation* (:data:`Op`) - and receives its answer.
The thread driver (:mod:`msgpatterns.runtime.thread_rounds`) performs the operations
with threads, the asyncio driver (:mod:`msgpatterns.runtime.async_rounds`) awaits
them: so both drivers share every decision and differ only in how they wait.

A batch handler's claims (the handler gets the list) are steps of the same machine
(:meth:`~ClaimRounds.prepared`, :meth:`~ClaimRounds.begin_all`,
:meth:`~ClaimRounds.batch_ran`, :meth:`~ClaimRounds.batch_stopped`), driven by one
batch-run procedure (:func:`msgpatterns.runtime.batches.run_batch`) on both drivers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from msgpatterns.errors import AckTimeout
from msgpatterns.idempotency.batch import BatchGuard, Entry
from msgpatterns.message import Message
from msgpatterns.observability.stats import DeliveryScope, Listener
from msgpatterns.ordering.executor import OrderedExecutor
from msgpatterns.runtime.lifecycle import Released

__all__ = [
    "STOPPED",
    "AckAll",
    "Bind",
    "CallBatch",
    "Claimed",
    "ClaimRounds",
    "Close",
    "Completions",
    "Fail",
    "Op",
    "Pause",
    "Performers",
    "Prepare",
    "Round",
    "Run",
    "Settle",
    "SettleUnrun",
    "Share",
    "StartScope",
    "Steps",
    "WakeWriter",
    "Write",
    "adrive",
    "drive",
    "expired",
]

R = TypeVar("R")


#: Starts a telemetry scope for a message run (the consumer's), or None.
StartScope = Callable[[Listener, Message], "DeliveryScope | None"]


def expired(error: BaseException | None) -> bool:
    """The settlement came from the runtime - the ack deadline
    (:class:`~msgpatterns.errors.AckTimeout`) or a stop handing the message back - not
    from its handler: it never takes the claim of a handler still running."""
    return isinstance(error, AckTimeout | Released)


class _Stopped:
    def __repr__(self) -> str:
        return "STOPPED"


#: The answer to :class:`Run` when the stop cancelled the handler (asyncio): the claim
#: is released and the procedure returns STOPPED, for the driver to end its worker.
STOPPED: Final[Any] = _Stopped()


# -- the bookkeeping ------------------------------------------------------------------


class Round:
    """The claimed messages of one batch claim: how many have not finished yet, and the
    messages to prepare again once they all have."""

    __slots__ = ("_left", "_lock", "lanes", "later")

    def __init__(self, size: int, later: list[Message],
                 lanes: OrderedExecutor | None) -> None:
        self._left = size
        self._lock = threading.Lock()
        #: Messages to prepare again after this round (their key is held by it).
        self.later = later
        #: Ordered mode: the lanes the round's handlers run on (None: the workers).
        self.lanes = lanes

    def ended(self) -> bool:
        """One message of the round is finished (its claim completed or released, or
        left to its settlement); True for the last one."""
        with self._lock:
            self._left -= 1
            return self._left == 0


@dataclass(eq=False, slots=True)
class Claimed:
    """A claimed message (waiting for a worker, or whose handler returned), with the
    round it belongs to."""

    batch: Round
    entry: Entry


class Completions:
    """The claims of handlers that returned, waiting to be completed: a group commit.

    A run whose handler returned :meth:`add`\\ s its claim. When no completion is being
    written, that makes a writer (:class:`WakeWriter`), which :meth:`take`\\ s
    everything queued, writes it in one round trip, sends those acks, and takes again
    until nothing is left. Otherwise the writer under way takes the claim next. So a
    claim is written as soon as the store is free - never held back for a handler
    still running - and the handlers that return while a round trip is under way share
    the next one. Thread-safe.
    """

    __slots__ = ("_lock", "_queue", "_writing")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: list[Claimed] = []
        self._writing = False

    def add(self, claimed: Claimed) -> bool:
        """Queue ``claimed``; True when a writer must now write."""
        with self._lock:
            self._queue.append(claimed)
            if self._writing:
                return False
            self._writing = True
            return True

    def abandon(self) -> None:
        """The writer dies (a ``BaseException`` from the store call): the next claim
        queued makes a new writer, who takes what is queued."""
        with self._lock:
            self._writing = False

    def take(self) -> list[Claimed]:
        """For the writer: everything queued, or an empty list - and then it is no
        longer the writer (atomically: a claim queued afterwards makes a new writer)."""
        with self._lock:
            taken, self._queue = self._queue, []
            if not taken:
                self._writing = False
            return taken


# -- the operations (what a procedure asks its driver to do) --------------------------


@dataclass(slots=True)
class Prepare:
    """One claim round trip for ``messages`` (:meth:`BatchGuard.prepare`, or awaited:
    ``aprepare``). Answer: their entries, in order."""

    messages: list[Message]


@dataclass(slots=True)
class Bind:
    """Bind each entry's delivery to a sink that drives :meth:`ClaimRounds.settled`:
    whoever settles the message outside its run finishes its claim first."""

    entries: list[Entry]


@dataclass(slots=True)
class SettleUnrun:
    """Settle a message whose handler does not run: a duplicate (``error`` None: a
    success), a key in progress, a conflict, a missing key, an unreachable store."""

    message: Message
    error: BaseException | None


@dataclass(slots=True)
class Share:
    """Queue claimed messages for any worker (in order, ahead of everything ready), or
    submit them to their keys' ``lanes``. ``inline``: the asking worker runs the round's
    first message itself (it is not among ``claimed``)."""

    claimed: list[Claimed]
    lanes: OrderedExecutor | None
    inline: bool


@dataclass(slots=True)
class Run:
    """Run ``entry``'s handler (the undecorated function), keeping what it returned in
    ``entry.result``. Answer: the error it raised, None, or :data:`STOPPED`."""

    entry: Entry


@dataclass(slots=True)
class CallBatch:
    """Call the batch handler (``batch=True``; the undecorated function when it is
    ``@idempotent``) with ``messages``. Answer: the error it raised, None, or
    :data:`STOPPED`."""

    messages: list[Message]


@dataclass(slots=True)
class Write:
    """Rule 2 for ``returned``, then rule 3 for ``raised`` (:meth:`BatchGuard.finish`,
    or awaited: ``afinish``); a failure is logged, never raised (the leases expire)."""

    returned: Sequence[Entry]
    raised: Sequence[Entry]


@dataclass(slots=True)
class AckAll:
    """Ack the messages whose claims were just completed (those settled meanwhile, or
    awaiting an explicit ack, are left alone); a failure is logged."""

    messages: list[Message]


@dataclass(slots=True)
class Fail:
    """The handler of ``message`` raised ``error`` (its claim is released): settle the
    delivery with it."""

    message: Message
    error: BaseException


@dataclass(slots=True)
class Close:
    """``entry``'s message was settled outside its run with ``error``: finish its claim
    (:meth:`BatchGuard.settled`, or awaited: ``asettled``); ``expired``: the deadline or
    a stop, which leave a running handler's claim to its run. Failures are logged."""

    entry: Entry
    error: BaseException | None
    expired: bool


@dataclass(slots=True)
class Settle:
    """Carry out the settlement of ``message`` (the driver's usual sink)."""

    message: Message
    error: BaseException | None


@dataclass(slots=True)
class Pause:
    """Let the handlers about to return do so (they join the next completion)."""


@dataclass(slots=True)
class WakeWriter:
    """A claim was queued and no completion is being written: make a writer drive
    :meth:`ClaimRounds.write_returned` (a thread of its own, or this very task).
    Answer: what that returned (:data:`STOPPED` or None), or None."""


Op = (Prepare | Bind | SettleUnrun | Share | Run | CallBatch | Write | AckAll | Fail | Close
      | Settle | Pause | WakeWriter)
#: A procedure in progress: yields operations, receives their answers, returns R.
Steps = Generator[Op, Any, R]

_PAUSE: Final = Pause()
_WAKE: Final = WakeWriter()


# -- the state machine -----------------------------------------------------------------


class ClaimRounds:
    """The claim rounds of one consumer's ``@idempotent`` handler.

    Args:
        guard: the handler's batch guard (its store steps and the six rules).
        writer_runs_handlers: the writer of completions is a worker (asyncio: the task
            whose handler returned) and runs the first handler of a round it starts
            itself; False: a writer thread of its own, which shares such a round out
            to the workers.
    """

    __slots__ = ("completions", "guard", "writer_runs_handlers")

    def __init__(self, guard: BatchGuard, *, writer_runs_handlers: bool) -> None:
        self.guard = guard
        self.writer_runs_handlers = writer_runs_handlers
        #: The claims of the handlers that returned, waiting for their round trip.
        self.completions = Completions()

    # -- a round: claim, settle what does not run, share out, run -----------------------

    def prepared(self, live: list[Message]) -> Steps[tuple[list[Entry], list[Message]]]:
        """One claim round trip for ``live``; the messages whose handler does not run
        are settled. Returns the claimed entries to run, and the messages to prepare
        again once those are finished (their key is held by an earlier message). Each
        claimed message finishes its claim before it is settled, whoever settles it."""
        entries: list[Entry] = yield Prepare(live)
        runs: list[Entry] = []
        later: list[Message] = []
        for entry in entries:
            if entry.later:
                later.append(entry.message)
            elif not entry.run:
                yield SettleUnrun(entry.message, entry.error)
            else:
                runs.append(entry)
        bound = [entry for entry in runs if entry.claim is not None]
        if bound:
            yield Bind(bound)
            # Settled before its sink was bound (a stop, a deadline while the claim
            # was under way): nothing finished its claim - free its key now, not when
            # its lease runs out (a stop may never run it).
            stale = [entry for entry in bound if entry.message.acked]
            if stale:
                yield Write((), stale)
        return runs, later

    def round(self, live: list[Message], lanes: OrderedExecutor | None = None, *,
              inline: bool = True) -> Steps[Any]:
        """One claim round for ``live``: claim, settle what does not run, then the
        handlers - on their keys' ``lanes``, or on the workers (the asking worker runs
        the first when ``inline``). Returns :data:`STOPPED` when the stop cancelled a
        handler run here."""
        if not live:
            return None
        runs, later = yield from self.prepared(live)
        if not runs:
            return None
        batch = Round(len(runs), later, lanes)
        claimed = [Claimed(batch, entry) for entry in runs]
        inline = inline and lanes is None
        shared = claimed[1:] if inline else claimed
        if shared:
            yield Share(shared, lanes, inline)
        if inline:
            return (yield from self.run(claimed[0]))
        return None

    def run(self, claimed: Claimed) -> Steps[Any]:
        """Run one claimed message's handler and finish its claim as it ends: released
        if it raised, queued for completion (with the claims of the handlers that
        return meanwhile) if it returned - never held for the rest of its round.
        Returns :data:`STOPPED` when the stop cancelled the handler.

        The same as :meth:`begin`, the :class:`Run` it returns, then :meth:`ran` -
        which a driver calls itself on its hot path (no procedure to drive when the
        claim was just queued)."""
        step = self.begin(claimed)
        if not isinstance(step, Run):
            return (yield from step)
        after = self.ran(claimed, (yield step))
        return None if after is None else (yield from after)

    def begin(self, claimed: Claimed) -> Run | Steps[Any]:
        """A worker took ``claimed``: the :class:`Run` of its handler to perform (from
        now on its deadline or a stop leaves its claim to that run), or - settled
        before it ran - the steps that end it without running."""
        entry = claimed.entry
        if self.guard.begin(entry) and not entry.message.acked:
            return Run(entry)
        return self._not_run(claimed)

    def _not_run(self, claimed: Claimed) -> Steps[Any]:
        entry = claimed.entry
        if entry.open:  # begun, but handed back or expired before it ran: free its key
            yield Write((), (entry,))
        # else: settled before it ran, its claim was released then
        return (yield from self._ended(claimed.batch))

    def ran(self, claimed: Claimed, error: BaseException | None) -> Steps[Any] | None:
        """The handler of ``claimed`` ended with ``error`` (the answer to its
        :class:`Run`): None when nothing is left to do here (its claim is queued and a
        writer under way takes it: its round is told once the claim is written), else
        the steps to drive."""
        if error is None and claimed.entry.message.auto_ack:
            return self._wake() if self.completions.add(claimed) else None
        return self._ran_otherwise(claimed, error)

    @staticmethod
    def _wake() -> Steps[Any]:
        return (yield _WAKE)

    def _ran_otherwise(self, claimed: Claimed, error: BaseException | None) -> Steps[Any]:
        entry = claimed.entry
        message = entry.message
        if error is STOPPED:  # the stop cancelled it (its message was handed back)
            yield Write((), (entry,))
            return STOPPED
        if error is None:  # awaiting its explicit ack: its claim is finished then
            if self.guard.end(entry):  # ... or now, when that came during the run
                returned = message.ack_error is None
                yield Write((entry,), ()) if returned else Write((), (entry,))
        else:
            yield Write((), (entry,))
            yield Fail(message, error)
        return (yield from self._ended(claimed.batch))

    def write_returned(self) -> Steps[Any]:
        """The writer of :class:`Completions`: complete the claims of the handlers that
        returned (one round trip for all queued), then ack their messages (DONE before
        ack); again until none is queued. Then the rounds all of whose claims are
        finished prepare the messages they held back. Returns :data:`STOPPED` when the
        stop cancelled a handler this writer ran."""
        completions = self.completions
        ended: list[Round] = []
        try:
            yield _PAUSE
            while claimed := completions.take():
                yield Write([c.entry for c in claimed], ())
                yield AckAll([c.entry.message for c in claimed])
                ended.extend(c.batch for c in claimed if c.batch.ended())
        except BaseException:  # the writer dies: what it took is not acked (the lease
            completions.abandon()  # window); the next writer takes the rest
            raise
        for batch in ended:
            if (yield from self._later(batch, inline=self.writer_runs_handlers)) is STOPPED:
                return STOPPED
        return None

    def _ended(self, batch: Round) -> Steps[Any]:
        if batch.ended():
            return (yield from self._later(batch, inline=True))
        return None

    def _later(self, batch: Round, *, inline: bool) -> Steps[Any]:
        """Every claim of ``batch`` is finished: the repeats of keys it held are
        duplicates now (or run, if the first copy failed). Those settled meanwhile (a
        stop handed them back) are left out."""
        if not batch.later:
            return None
        return (yield from self.round([m for m in batch.later if not m.acked],
                                      batch.lanes, inline=inline))

    # -- a claimed message settled outside its run -----------------------------------

    def settled(self, entry: Entry, message: Message,
                error: BaseException | None) -> Steps[None]:
        """The sink of a claimed delivery settled outside its run (an explicit ack, its
        deadline, a stop): its claim is finished first - completed on a success,
        released on a failure, except that the deadline or a stop leaves the claim of
        a handler still running to that run - then the delivery is settled."""
        if entry.open:
            yield Close(entry, error, expired(error))
        yield Settle(message, error)

    # -- a batch handler's claims (the handler gets the list) ---------------------------

    def begin_all(self, runs: list[Entry]) -> Steps[list[Message]]:
        """The messages of ``runs`` a batch handler runs: each claim begun (from now on
        the handler's end finishes it); a message settled before (handed back, expired)
        has its claim released and is left out."""
        guard = self.guard
        live: list[Message] = []
        for entry in runs:
            if not guard.begin(entry):
                continue  # released when it was settled
            if entry.message.acked:
                yield Write((), (entry,))
                continue
            live.append(entry.message)
        return live

    def batch_ran(self, entries: dict[Message, Entry], returned: list[Message],
                  raised: list[tuple[Message, BaseException]],
                  explicit: list[Message]) -> Steps[None]:
        """A batch handler ended: the claims of the messages that returned are
        completed and those that raised - or that the handler failed with its own
        ``message.ack(error)`` during the run - released (one round trip); a message
        awaiting its explicit ack finishes its claim then - or now, when that ack came
        during the run. Then the failures are settled and the successes acked (DONE
        before ack)."""
        guard = self.guard
        if entries:
            done: list[Entry] = []
            failed = [entries[m] for m, _ in raised if m in entries]
            for message in returned:
                entry = entries.get(message)
                if entry is None:
                    continue
                error = message.delivery.error
                # acked with an error by its own handler during the run: a failure (a
                # deadline or a stop meanwhile: its handler returned, the effect stays)
                (failed if error is not None and not expired(error) else done).append(entry)
            yield Write(done, failed)
            for message in explicit:
                entry = entries.get(message)
                if entry is not None and guard.end(entry):
                    ok = message.ack_error is None
                    yield Write((entry,), ()) if ok else Write((), (entry,))
        for message, failed_with in raised:
            yield Fail(message, failed_with)
        if returned:
            yield AckAll(returned)

    @staticmethod
    def batch_stopped(entries: Mapping[Message, Entry]) -> Steps[None]:
        """The stop cancelled a batch handler (asyncio; its messages were handed back):
        the claims it held are released - their keys are free again at once, not when
        their leases run out."""
        if entries:
            yield Write((), list(entries.values()))


#: What performs each kind of operation: its driver's function, given the operation,
#: returning the answer (awaitable for the asyncio driver).
Performers = Mapping[type[Any], Callable[[Any], Any]]


def drive(steps: Steps[R], perform: Performers) -> R:
    """Drive ``steps`` to their end with the thread driver: each operation performed
    (``perform[type(op)](op)``) and its answer sent back; an exception it raises is
    thrown back in (the procedure cleans up - the writer gives up its turn - and
    re-raises). Returns what the procedure returned."""
    reply: Any = None
    error: BaseException | None = None
    while True:
        try:
            op = steps.send(reply) if error is None else steps.throw(error)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        error = None
        try:
            reply = perform[type(op)](op)
        except BaseException as exc:  # thrown back in above
            error, reply = exc, None


async def adrive(steps: Steps[R], perform: Performers) -> R:
    """:func:`drive` for the asyncio driver: each operation awaited."""
    reply: Any = None
    error: BaseException | None = None
    while True:
        try:
            op = steps.send(reply) if error is None else steps.throw(error)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]
        error = None
        try:
            reply = await perform[type(op)](op)
        except BaseException as exc:  # thrown back in above (CancelledError too)
            error, reply = exc, None
