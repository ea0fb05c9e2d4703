"""Generated failure schedules through ``Consumer`` + ``@idempotent`` / ``VersionGuard``.

A *schedule* is a workload (keys, each published 1-5 times) run on an
:class:`InMemoryBroker` with seeded faults (duplicate deliveries, reordering, lost
acks), simulated process crashes at every step boundary, transient store errors and
1 or 4 workers. Each schedule counts, per key, how many times its effect was applied:

* ``lost``: keys whose effect was never applied;
* ``doubled``: extra applications (effect count - 1, summed over keys).

How a crash is modelled (what a real process crash leaves behind):

* the work done so far stays (store rows, PROCESSING leases, committed transactions);
  an open transaction rolls back (the database does that when a connection dies);
* nothing after the crash point reaches anyone: the claim is not released, the
  completion is not written, the broker hears no ack and no nack. The delivery is
  redelivered by the broker when its visibility timeout expires (virtual time).

Every fault has a budget (crashes and transient errors: about one or two per message
published; the broker's duplicate injection stays at or under 20% per delivery), so
the branching of redeliveries stays subcritical and every schedule ends.

Crash points: ``before_write`` (claimed, no effect yet), ``after_write`` (effect
applied - committed for a lease checker, still in the open transaction for
TransactionalSqlChecker - before the completion) and ``after_complete`` (DONE written,
the ack never sent).

The lease checkers' documented window (docs/idempotency.md): a crash between the
effect and the DONE mark applies the effect again once the lease expires. So for them
``doubled`` must equal the number of ``after_write`` crashes *exactly*, key by key;
for TransactionalSqlChecker and the VersionGuard paths ``doubled`` must be 0.
"""

from __future__ import annotations

import collections
import os
import random
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from msgpatterns import Consumer
from msgpatterns.brokers.memory import InMemoryBroker
from msgpatterns.message import Message
from msgpatterns.retry import Backoff, RetryPolicy

POINTS = ("before_write", "after_write", "after_complete")

#: Schedules per combination; a combination's ``weight`` multiplies it.
PROFILES = {"ci": 100, "soak": 5000, "quick": 5}


def profile() -> str:
    """The Hypothesis profile chosen by ``MSGPATTERNS_SOAK`` (``ci`` by default)."""
    name = os.environ.get("MSGPATTERNS_SOAK", "ci") or "ci"
    if name not in PROFILES:
        raise ValueError(f"MSGPATTERNS_SOAK must be one of {sorted(PROFILES)}, got {name!r}")
    return name


def examples(weight: float) -> int:
    """Schedules for a combination of ``weight`` under the current profile."""
    return max(1, round(PROFILES[profile()] * weight))


# -- totals printed at the end of the session --------------------------------------------


@dataclass
class Totals:
    schedules: int = 0
    messages: int = 0
    deliveries: int = 0
    crashes: int = 0
    lost: int = 0
    doubled: int = 0
    stranded: int | None = None  # pending after the run drained (fault lines)
    recover: float | None = None  # the slowest recovery, in seconds (fault lines)


TOTALS: dict[str, Totals] = collections.defaultdict(Totals)
_totals_lock = threading.Lock()


def record(combination: str, outcome: Outcome) -> None:
    with _totals_lock:
        t = TOTALS[combination]
        t.schedules += 1
        t.messages += outcome.messages
        t.deliveries += outcome.deliveries
        t.crashes += sum(outcome.crashes.values())
        t.lost += outcome.lost
        t.doubled += outcome.doubled


def record_fault(combination: str, messages: int, kills: int, lost: int, doubled: int,
                 *, stranded: int | None = None, recover: float | None = None) -> None:
    """A fault test's run: one schedule, ``kills`` faults injected (in ``crashes``);
    ``stranded``: messages still pending after the run drained (without waiting for a
    visibility timeout); ``recover``: seconds from the fault to the next settlement."""
    with _totals_lock:
        t = TOTALS[combination]
        t.schedules += 1
        t.messages += messages
        t.crashes += kills
        t.lost += lost
        t.doubled += doubled
        if stranded is not None:
            t.stranded = (t.stranded or 0) + stranded
        if recover is not None:
            t.recover = max(t.recover or 0.0, recover)


def summary_lines() -> list[str]:
    return [
        f"reliability: {name} schedules={t.schedules} messages={t.messages} "
        f"deliveries={t.deliveries} faults={t.crashes} lost={t.lost} doubled={t.doubled}"
        + ("" if t.stranded is None else f" stranded={t.stranded}")
        + ("" if t.recover is None else f" recover_s={t.recover:.2f}")
        for name, t in sorted(TOTALS.items())
    ]


# -- the schedule --------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule:
    """One generated run. Everything random derives from ``seed``."""

    keys: int
    max_copies: int
    duplicate_rate: float
    reorder_window: int
    lost_ack_rate: float
    crash_rate: float
    crash_points: frozenset[str]
    transient_rate: float
    seed: int


class Crash(Exception):
    """A simulated process crash: nothing after the raising point reaches the broker
    or the store (see the module docstring)."""


class CrashingBroker(InMemoryBroker):
    """An InMemoryBroker that never hears from a crashed delivery: its ack, nack or
    dead letter is dropped, so it comes back after the visibility timeout."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dead: set[Any] = set()

    def ack(self, message: Message) -> None:
        if message.receipt not in self.dead:
            super().ack(message)

    def nack(self, message: Message, delay: float = 0.0) -> None:
        if message.receipt not in self.dead:
            super().nack(message, delay)

    def dead_letter(self, message: Message, record: Any) -> None:
        if message.receipt not in self.dead:
            super().dead_letter(message, record)


class CrashPlan:
    """Decides, per handler call, whether (and where) the process crashes."""

    def __init__(self, schedule: Schedule, broker: CrashingBroker, budget: int) -> None:
        self.rng = random.Random(schedule.seed ^ 0x5EED)
        self.rate = schedule.crash_rate if schedule.crash_points else 0.0
        self.points = sorted(schedule.crash_points)
        self.budget = budget
        self.broker = broker
        self.crashes: collections.Counter[str] = collections.Counter()
        self.after_write: collections.Counter[str] = collections.Counter()  # per key
        self.local = threading.local()
        self._lock = threading.Lock()

    def decide(self) -> str | None:
        with self._lock:
            if self.budget <= 0 or self.rng.random() >= self.rate:
                return None
            self.budget -= 1
            point = self.rng.choice(self.points)
            self.crashes[point] += 1
            return point

    def crash(self, message: Message, point: str) -> None:
        """Crash here: the delivery is abandoned (the broker hears nothing more)."""
        self.broker.dead.add(message.receipt)
        if point == "after_write":
            with self._lock:
                self.after_write[str(message.key)] += 1
        self.local.crashing = True
        raise Crash(point)

    def lose_ack(self, message: Message) -> None:
        """Crash after completion: the effect and the DONE mark stay, the ack is lost."""
        self.broker.dead.add(message.receipt)

    def take_crashing(self) -> bool:
        """True once after :meth:`crash` on this thread (the dead process sends nothing)."""
        crashing = getattr(self.local, "crashing", False)
        self.local.crashing = False
        return crashing


class Transient:
    """Raises a store's transient error at ``rate`` (seeded), never more than ``cap``
    times in a row on one thread for an operation that has a cap."""

    def __init__(self, rate: float, seed: int, make_error: Callable[[], BaseException],
                 budget: int = 1_000_000) -> None:
        self.rate = rate
        self.budget = budget
        self.rng = random.Random(seed ^ 0x7A11)
        self.make_error = make_error
        self.local = threading.local()
        self.injected = 0
        self._lock = threading.Lock()

    def maybe_fail(self, op: str, cap: int | None = None) -> None:
        if not self.rate:
            return
        streaks = self.local.__dict__.setdefault("streaks", collections.Counter())
        with self._lock:
            fail = self.rng.random() < self.rate and self.injected < self.budget
            if fail and (cap is None or streaks[op] < cap):
                self.injected += 1
            else:
                fail = False
        if fail:
            streaks[op] += 1
            raise self.make_error()
        streaks[op] = 0

    def wrap(self, obj: Any, name: str, cap: int | None = None) -> None:
        """Make ``obj.name`` fail transiently before doing its work."""
        original = getattr(obj, name)

        def failing(*args: Any, **kwargs: Any) -> Any:
            self.maybe_fail(name, cap)
            return original(*args, **kwargs)

        setattr(obj, name, failing)


# -- one run -----------------------------------------------------------------------------


@dataclass
class Outcome:
    messages: int
    deliveries: int
    crashes: collections.Counter[str]
    effects: collections.Counter[str]
    expected_doubles: collections.Counter[str]
    keys: list[str]
    pending: int
    dead_letters: int
    transient: int = 0
    lost: int = 0
    doubled: int = 0
    lost_keys: list[str] = field(default_factory=list)

    def count(self) -> None:
        self.lost_keys = [k for k in self.keys if self.effects[k] == 0]
        self.lost = len(self.lost_keys)
        self.doubled = sum(max(n - 1, 0) for n in self.effects.values())

    def describe(self) -> str:
        return (f"messages={self.messages} deliveries={self.deliveries} "
                f"crashes={dict(self.crashes)} transient={self.transient} "
                f"lost={self.lost_keys} effects={dict(self.effects)} "
                f"expected_doubles={dict(self.expected_doubles)} pending={self.pending} "
                f"dead={self.dead_letters}")


@dataclass
class Run:
    """What a target gets to build its handler for one schedule."""

    schedule: Schedule
    broker: CrashingBroker
    plan: CrashPlan
    id: str
    topic: str
    messages: int  # published

    def transient(self, make_error: Callable[[], BaseException]) -> Transient:
        """Transient store errors at the schedule's rate, at most two per message
        published (a fault budget, so every schedule ends)."""
        return Transient(self.schedule.transient_rate, self.schedule.seed, make_error,
                         budget=2 * self.messages)


def workload(schedule: Schedule) -> tuple[list[str], list[tuple[str, dict[str, Any], str]]]:
    """Keys and the (key, body, id) publishes: each key 1..max_copies times, copies
    sometimes resent with the same message id (a producer retry), sometimes with a new
    one (a resend by another producer), in a shuffled order."""
    rng = random.Random(schedule.seed)
    keys = [f"k{i}" for i in range(schedule.keys)]
    publishes: list[tuple[str, dict[str, Any], str]] = []
    for key in keys:
        first = uuid.UUID(int=rng.getrandbits(128), version=4).hex
        for _ in range(rng.randint(1, schedule.max_copies)):
            same = rng.random() < 0.5
            mid = first if same else uuid.UUID(int=rng.getrandbits(128), version=4).hex
            publishes.append((key, {"key": key}, mid))
    rng.shuffle(publishes)
    return keys, publishes


# Redeliveries wait past the visibility timeout, so a message waiting for another (a
# strict version chain) waits for the crashed one to come back instead of multiplying
# through the broker's duplicate injection on every redelivery.
POLICY = RetryPolicy(max_attempts=1_000_000, backoff=Backoff.fixed(61.0), local_retries=0)


def run_schedule(
    schedule: Schedule,
    workers: int,
    build: Callable[[Run], tuple[Callable[[Message], Any], Callable[[], collections.Counter[str]]]],
    *,
    messages: Callable[[Schedule], tuple[list[str], list[tuple[str, dict[str, Any], str]]]]
    = workload,
    timeout: float = 10.0,
) -> Outcome:
    """Publish the workload, consume it to idle with ``build``'s handler, count effects.

    ``build(run)`` returns the handler and a function that reads the effect counts
    (key -> applications) once the run is idle.
    """
    broker = CrashingBroker(
        seed=schedule.seed, duplicate_rate=schedule.duplicate_rate,
        reorder_window=schedule.reorder_window, lost_ack_rate=schedule.lost_ack_rate,
        visibility_timeout=60.0, record_history=False,
    )
    keys, publishes = messages(schedule)
    plan = CrashPlan(schedule, broker, budget=len(publishes) + 2)
    run = Run(schedule, broker, plan, uuid.uuid4().hex[:12], "t", len(publishes))
    handler, read_effects = build(run)
    for key, body, mid in publishes:
        broker.publish(run.topic, body, key=key, id=mid)
    consumer = Consumer(
        broker, handler, topics=[run.topic], group="g", workers=workers, retry=POLICY,
        ack_timeout=0, poll_timeout=0.01, max_in_flight=8, fetch_batch=4,
    )
    try:
        consumer.run_until_idle(timeout=timeout)
    finally:
        consumer.stop(0)
    outcome = Outcome(
        messages=len(publishes), deliveries=broker.stats.delivered, crashes=plan.crashes,
        effects=read_effects(), expected_doubles=plan.after_write, keys=keys,
        pending=broker.pending, dead_letters=len(broker.dead_letters),
    )
    outcome.count()
    return outcome
