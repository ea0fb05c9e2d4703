"""The sans-I/O claim-round core (msgpatterns.runtime.rounds.ClaimRounds) on its own.

The core yields operations and never waits, so a test can be its driver: one thread
plays every worker, every writer and the clock. Hypothesis draws the order of
everything - which suspended procedure goes on next, when a running handler returns,
raises or is cancelled by a stop, when an ack deadline passes, when the consumer
stops, when the handler of an explicit-ack message acks, when the store refuses a
claim or fails a write - on both driver shapes (a writer thread of its own, the
thread driver; the worker whose handler returned writes, the asyncio driver).

Whatever the order, the rules fixed for issue 19 (hole 1) hold:

* a claim is never released after its handler returned successfully (or its
  message was explicitly acked as a success);
* a claim is never completed before its handler returned (or acked it explicitly);
* DONE before ack: a claimed message is acked only after its claim was written;
* every claim is finished once, every message settled once.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, get_args

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from msgpatterns import Message
from msgpatterns.delivery import Delivery
from msgpatterns.errors import AckTimeout, StoreUnavailable
from msgpatterns.idempotency import MemoryChecker, Status, idempotent
from msgpatterns.idempotency.batch import BatchGuard, Entry, guard_of
from msgpatterns.idempotency.records import Claim
from msgpatterns.runtime.lifecycle import Released
from msgpatterns.runtime.rounds import (
    STOPPED,
    AckAll,
    Bind,
    Claimed,
    ClaimRounds,
    Close,
    Completions,
    Fail,
    Op,
    Pause,
    Prepare,
    Round,
    Run,
    Settle,
    SettleUnrun,
    Share,
    WakeWriter,
    Write,
    adrive,
    drive,
)

GROUP = "g"
#: Every kind of operation the rounds ask for.
OPS = get_args(Op)


@pytest.fixture(autouse=True)
def quiet_logs() -> Iterator[None]:
    """Late acks and failed writes are what these orders are about: errors only."""
    logger = logging.getLogger("msgpatterns")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


class FlakyChecker(MemoryChecker):
    """A MemoryChecker whose next claim round trip can be made to fail."""

    refuse_next_claim = False

    def claim_stored(self, store_keys: Sequence[str],
                     fingerprints: Sequence[str | None]) -> list[Claim]:
        if self.refuse_next_claim:
            self.refuse_next_claim = False
            raise StoreUnavailable("the store is down")
        return super().claim_stored(store_keys, fingerprints)


class Boom(Exception):
    """A handler's failure."""


@dataclass(eq=False)
class Task:
    """A worker, a writer or a settlement: a stack of procedures (the asyncio writer
    runs write_returned nested in the worker whose handler returned)."""

    stack: list[Generator[Op, Any, Any]]
    reply: Any = None
    #: The Run the task waits on (a handler running), or None.
    running: Run | None = None


@dataclass
class Record:
    """What happened, per entry and per message, and the invariants checked on it."""

    events: list[tuple[str, Any]] = field(default_factory=list)
    #: entry -> "complete", "release" or "lost" (a failed write): once.
    finished: dict[Entry, str] = field(default_factory=dict)
    returned_ok: set[Entry] = field(default_factory=set)  # auto-ack handler returned
    confirmed: set[Entry] = field(default_factory=set)  # explicit ack(None)
    refused: set[Entry] = field(default_factory=set)  # explicit ack(error)
    running: set[Entry] = field(default_factory=set)
    settlements: dict[Message, list[BaseException | None]] = field(default_factory=dict)

    def finish(self, entry: Entry, how: str) -> None:
        assert entry not in self.finished, f"{entry.message.id}: finished twice"
        ok = entry in self.returned_ok or entry in self.confirmed
        if how == "complete":
            assert ok, f"{entry.message.id}: completed before its handler returned"
        if how == "release":
            assert not ok, f"{entry.message.id}: released after its handler returned"
            assert entry not in self.running or entry in self.refused, (
                f"{entry.message.id}: a running handler's claim was taken")
        self.finished[entry] = how
        self.events.append((how, entry.message.id))

    def settle(self, message: Message, error: BaseException | None,
               entries: dict[Message, Entry]) -> None:
        self.settlements.setdefault(message, []).append(error)
        entry = entries.get(message)
        if error is None and entry is not None and entry.claim is not None:
            assert entry in self.finished and self.finished[entry] != "release", (
                f"{message.id}: acked before DONE was written")
        self.events.append(("settle", message.id))


class Simulation:
    """Drives a ClaimRounds with one thread, in the order Hypothesis draws."""

    def __init__(self, data: st.DataObject, *, writer_runs_handlers: bool,
                 keys: list[str], done: set[str], held: set[str]) -> None:
        self.data = data
        self.checker = FlakyChecker(lease=60)
        for key in done:
            self.checker.complete(self.checker.claim(key, group=GROUP))
        for key in held:  # a live owner elsewhere
            self.checker.claim(key, group=GROUP)

        @idempotent(self.checker, group=GROUP)
        def handle(message: Message) -> None:
            raise AssertionError("the simulation runs no handler")

        guard = guard_of(handle)
        assert isinstance(guard, BatchGuard)
        self.guard = guard
        self.writer_runs = writer_runs_handlers
        self.core = ClaimRounds(guard, writer_runs_handlers=writer_runs_handlers)
        self.messages = [Message(i, id=f"m{i}", key=key) for i, key in enumerate(keys)]
        for message in self.messages:
            message.delivery.bind(self.plain_sink)
        self.tasks: list[Task] = []
        self.ready: deque[Claimed] = deque()
        self.record = Record()
        self.entries: dict[Message, Entry] = {}
        self.stopped = False
        self.fail_next_write = False

    # -- the sinks ----------------------------------------------------------------

    def plain_sink(self, message: Message, error: BaseException | None) -> None:
        self.record.settle(message, error, self.entries)

    def claimed_sink(self, entry: Entry, message: Message,
                     error: BaseException | None) -> None:
        self.tasks.append(Task([self.core.settled(entry, message, error)]))

    # -- the operations -------------------------------------------------------------

    def perform(self, task: Task, op: Op) -> None:
        """Carry out ``op`` for ``task`` (a Run parks it until its handler ends)."""
        reply: Any = None
        if isinstance(op, Prepare):
            reply = self.guard.prepare(op.messages)
            for entry in reply:
                self.entries[entry.message] = entry
        elif isinstance(op, Bind):
            for entry in op.entries:
                entry.message.delivery.bind(partial(self.claimed_sink, entry))
        elif isinstance(op, SettleUnrun):
            op.message.delivery.finish(op.message, op.error)
        elif isinstance(op, Share):
            assert op.lanes is None
            self.ready.extend(op.claimed)
        elif isinstance(op, Run):
            task.running = op
            entry = op.entry
            self.record.running.add(entry)
            if self.data.draw(st.booleans(), label=f"{entry.message.id} acks itself"):
                entry.message.disable_auto_ack()
            return
        elif isinstance(op, Write):
            self.write(op.returned, op.raised)
        elif isinstance(op, AckAll):
            for message in Delivery.settle_all_quietly(op.messages):
                self.record.settle(message, None, self.entries)
        elif isinstance(op, Fail):
            op.message.delivery.finish(op.message, op.error)
        elif isinstance(op, Close):
            was_open = op.entry.open
            self.guard.settled(op.entry, op.error, expired=op.expired)
            if was_open and not op.entry.open:
                self.record.finish(op.entry, "complete" if op.error is None else "release")
        elif isinstance(op, Settle):
            self.record.settle(op.message, op.error, self.entries)
        elif isinstance(op, Pause):
            pass
        elif isinstance(op, WakeWriter):
            if self.writer_runs:  # this worker writes now: the answer is its outcome
                task.stack.append(self.core.write_returned())
            else:  # a writer thread of its own
                self.tasks.append(Task([self.core.write_returned()]))
        else:  # pragma: no cover
            raise AssertionError(op)
        task.reply = reply

    def write(self, returned: Sequence[Entry], raised: Sequence[Entry]) -> None:
        open_before = {entry for entry in [*returned, *raised] if entry.open}
        if self.fail_next_write:  # a closed checker: taken, not written (logged)
            self.fail_next_write = False
            for entry in self.guard.take([*returned, *raised]):
                self.record.finish(entry, "lost")
            return
        self.guard.finish(returned, raised)
        for entry in returned:
            if entry in open_before:
                self.record.finish(entry, "complete")
        for entry in raised:
            if entry in open_before:
                self.record.finish(entry, "release")

    # -- the scheduler --------------------------------------------------------------

    def step(self, task: Task) -> None:
        """Send ``task`` its answer and perform what it asks next."""
        gen = task.stack[-1]
        try:
            op = gen.send(task.reply)
        except StopIteration as done:
            task.stack.pop()
            if not task.stack:
                self.tasks.remove(task)
                return
            task.reply = done.value  # the nested writer's outcome, to its worker
            return
        task.reply = None
        self.perform(task, op)

    def end_run(self, task: Task, outcome: str) -> None:
        run = task.running
        assert run is not None
        entry = run.entry
        task.running = None
        self.record.running.discard(entry)
        if outcome == "return":
            if entry.message.auto_ack:
                self.record.returned_ok.add(entry)
            task.reply = None
        elif outcome == "raise":
            task.reply = Boom(entry.message.id)
        else:  # the stop cancelled it (asyncio)
            task.reply = STOPPED

    def explicit_ack(self, message: Message, ok: bool) -> None:
        entry = self.entries.get(message)
        if entry is not None and not message.acked:
            (self.record.confirmed if ok else self.record.refused).add(entry)
        message.ack(None if ok else Boom("refused"))

    def stop(self) -> None:
        self.stopped = True
        for message in self.messages:
            message.delivery.expire(message, Released("consumer stopped"))

    def actions(self) -> list[tuple[str, Any]]:
        found: list[tuple[str, Any]] = []
        for task in self.tasks:
            if task.running is None:
                found.append(("step", task))
            else:
                found.append(("return", task))
                found.append(("raise", task))
                if self.stopped and self.writer_runs:
                    found.append(("cancel", task))
        if self.ready and not self.stopped:
            found.append(("take", None))
        for message in self.messages:
            if message.acked:
                continue
            found.append(("deadline", message))
            if not message.auto_ack:
                found.append(("ack", message))
                found.append(("nack", message))
        if not self.stopped:
            found.append(("stop", None))
        if not self.fail_next_write:
            found.append(("fail write", None))
        if not self.checker.refuse_next_claim:
            found.append(("refuse claim", None))
        return found

    def act(self, what: str, arg: Any) -> None:
        if what == "step":
            self.step(arg)
        elif what in ("return", "raise", "cancel"):
            self.end_run(arg, what)
        elif what == "take":
            self.tasks.append(Task([self.core.run(self.ready.popleft())]))
        elif what == "deadline":
            arg.delivery.expire(arg, AckTimeout(f"{arg.id}: deadline"))
        elif what in ("ack", "nack"):
            self.explicit_ack(arg, what == "ack")
        elif what == "stop":
            self.stop()
        elif what == "fail write":
            self.fail_next_write = True
        elif what == "refuse claim":
            self.checker.refuse_next_claim = True

    def run(self, steps: int) -> None:
        for _ in range(steps):
            found = self.actions()
            if not found:
                break
            index = self.data.draw(st.integers(0, len(found) - 1), label="action")
            self.act(*found[index])
        self.drain()

    def drain(self) -> None:
        """Let everything end: handlers return, explicit-ack messages are acked,
        claimed messages left are run (or dropped after a stop, as both drivers do)."""
        self.fail_next_write = False
        self.checker.refuse_next_claim = False
        while True:
            if self.tasks:
                task = self.tasks[0]
                if task.running is None:
                    self.step(task)
                else:
                    self.end_run(task, "return")
                continue
            if self.ready and not self.stopped:
                self.tasks.append(Task([self.core.run(self.ready.popleft())]))
                continue
            waiting = [m for m in self.messages if not m.acked and not m.auto_ack]
            if waiting:
                self.explicit_ack(waiting[0], ok=True)
                continue
            if self.ready:  # stopped: the drivers drop what never ran
                self.ready.clear()
            return

    def check_end(self) -> None:
        record = self.record
        for message in self.messages:
            assert len(record.settlements.get(message, [])) == 1, (
                f"{message.id} settled {record.settlements.get(message)}")
        for message, entry in self.entries.items():
            if entry.claim is None:
                continue
            assert not entry.open, f"{message.id}: its claim was never finished"
        completed = {e.message.key for e, how in record.finished.items() if how == "complete"}
        for key in completed:
            assert self.checker.claim(key, group=GROUP).status is Status.DONE


SETTINGS = settings(max_examples=int(os.environ.get("CLAIM_CORE_EXAMPLES", "300")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.data_too_large])


@pytest.mark.parametrize("writer_runs_handlers", [False, True],
                         ids=["thread-driver", "asyncio-driver"])
@SETTINGS
@given(data=st.data(),
       keys=st.lists(st.sampled_from("abcdef"), min_size=1, max_size=8),
       done=st.sets(st.sampled_from("abcdef"), max_size=2),
       held=st.sets(st.sampled_from("abcdef"), max_size=1),
       rounds=st.integers(1, 2), steps=st.integers(0, 60))
def test_any_order_of_events_keeps_the_claim_rules(
        writer_runs_handlers: bool, data: st.DataObject, keys: list[str], done: set[str],
        held: set[str], rounds: int, steps: int) -> None:
    sim = Simulation(data, writer_runs_handlers=writer_runs_handlers, keys=keys,
                     done=done, held=held - done)
    cut = len(sim.messages) // 2 if rounds == 2 else len(sim.messages)
    for part in (sim.messages[:cut], sim.messages[cut:]):
        if part:
            sim.tasks.append(Task([sim.core.round(list(part))]))
    sim.run(steps)
    sim.check_end()


# -- a few orders written out ------------------------------------------------------------


class NoDraws:
    """Stands for Hypothesis' data where a scenario drives every step: every handler
    acks automatically."""

    def draw(self, strategy: Any, label: str = "") -> Any:
        return False


def _sim(keys: str, *, writer_runs_handlers: bool = False) -> Simulation:
    return Simulation(NoDraws(), writer_runs_handlers=writer_runs_handlers,  # type: ignore[arg-type]
                      keys=list(keys), done=set(), held=set())


def _until_run(sim: Simulation, task: Task) -> None:
    while task.running is None:
        sim.step(task)


def test_a_deadline_during_a_slow_handler_leaves_the_returned_claims_completed() -> None:
    sim = _sim("ab")
    worker = Task([sim.core.round(list(sim.messages))])
    sim.tasks.append(worker)
    _until_run(sim, worker)  # a runs; b waits in the ready queue
    other = Task([sim.core.run(sim.ready.popleft())])
    sim.tasks.append(other)
    _until_run(sim, other)
    sim.end_run(other, "return")  # b returned: its claim is queued for the writer
    for message in sim.messages:  # the deadline passes for both
        message.delivery.expire(message, AckTimeout("deadline"))
    sim.drain()
    sim.check_end()
    finished = {e.message.id: how for e, how in sim.record.finished.items()}
    assert finished == {"m0": "complete", "m1": "complete"}


def test_a_stop_cancelling_a_handler_releases_only_its_claim() -> None:
    sim = _sim("ab", writer_runs_handlers=True)
    worker = Task([sim.core.round(list(sim.messages))])
    sim.tasks.append(worker)
    _until_run(sim, worker)
    other = Task([sim.core.run(sim.ready.popleft())])
    sim.tasks.append(other)
    _until_run(sim, other)
    sim.end_run(other, "return")
    while other in sim.tasks:  # b's claim completed, b acked
        sim.step(other)
    sim.stop()
    sim.end_run(worker, "cancel")
    sim.drain()
    sim.check_end()
    finished = {e.message.id: how for e, how in sim.record.finished.items()}
    assert finished == {"m0": "release", "m1": "complete"}


def test_a_repeated_key_waits_for_its_round_then_is_a_duplicate() -> None:
    sim = _sim("aa")
    sim.tasks.append(Task([sim.core.round(list(sim.messages))]))
    sim.drain()
    sim.check_end()
    assert [e for e, how in sim.record.finished.items() if how == "complete"] == [
        sim.entries[sim.messages[0]]]
    assert sim.record.settlements[sim.messages[1]] == [None]  # acked as a duplicate


# -- the thin loops ------------------------------------------------------------------------


def test_drive_throws_a_driver_failure_back_in_and_the_writer_gives_up_its_turn() -> None:
    completions = Completions()
    guard = guard_of(idempotent(MemoryChecker(), group=GROUP)(lambda m: None))
    assert guard is not None
    core = ClaimRounds(guard, writer_runs_handlers=False)
    core.completions = completions
    entry = Entry(Message(1, id="x"), True)
    assert completions.add(Claimed(_round(), entry))

    def perform(op: Op) -> Any:
        if isinstance(op, Write):
            raise SystemExit("the process dies here")
        return None

    with pytest.raises(SystemExit):
        drive(core.write_returned(), dict.fromkeys(OPS, perform))
    assert completions.add(Claimed(_round(), entry))  # a new writer takes over


def test_adrive_answers_each_operation_and_returns_the_outcome() -> None:
    guard = guard_of(idempotent(MemoryChecker(), group=GROUP)(lambda m: None))
    assert guard is not None
    core = ClaimRounds(guard, writer_runs_handlers=True)
    message = Message(1, id="x", key="k")
    seen: list[str] = []

    async def perform(op: Op) -> Any:
        seen.append(type(op).__name__)
        if isinstance(op, Prepare):
            return guard.prepare(op.messages)
        if isinstance(op, Run):
            return STOPPED
        if isinstance(op, Write):
            guard.finish(op.returned, op.raised)
        return None

    assert asyncio.run(adrive(core.round([message]), dict.fromkeys(OPS, perform))) is STOPPED
    assert seen == ["Prepare", "Bind", "Run", "Write"]


def _round() -> Round:
    return Round(1, [], None)
