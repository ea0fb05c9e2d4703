"""Differential: batch claims vs per-message claims, on the same generated schedules.

Batch claims (one ``claim_many`` per round of fetched messages, each claim completed as
its handler returns) are a fast path of ``@idempotent`` in the ``Consumer`` and the
``AsyncConsumer``; its plain twin is the decorator claiming and completing each message
on its own (what the runtime does when the ``@idempotent`` handler is wrapped in a plain
function - tests/claim_drivers.py). Hypothesis generates a schedule - keys published 1-3
times, each key's handler fine, failing once (``NeedRetry``), always refusing
(``Reject``), brief, or slow past its ack deadline; an optional graceful
``stop(timeout)`` part-way and a restart; workers and batch sizes - and both paths run
it on the same driver. They must agree:

* the same effects: each key's effect applied exactly once (never for a refused key),
  none lost, none doubled;
* the same settlement of each message: acked, or dead-lettered with the same error;
* a key that failed once was retried (a nack before its ack) on both.

(Retries that only wait - ``InProgress`` while another copy of the key runs, a
deadline or a stop handing a message back - depend on timing and are not compared.)

``MSGPATTERNS_SOAK`` picks the number of schedules (``ci`` by default, ``soak`` for
many more; see reliability_harness.py); each driver's totals are printed at the end.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_harness import examples, record_fault

from claim_drivers import Driver, Sleep, Until, driver
from msgpatterns import InMemoryBroker, Message, NeedRetry, Reject, RetryPolicy
from msgpatterns.retry import Backoff

__all__ = ["driver"]  # the fixture

pytestmark = pytest.mark.timeout(600)

BEHAVIOURS = ("ok", "fail_once", "reject", "brief", "slow")
#: Waiting retries (InProgress) count as attempts: never let them dead-letter a message.
RETRY = RetryPolicy(max_attempts=10_000, backoff=Backoff.fixed(0.5), local_retries=0)


@dataclass(frozen=True)
class Schedule:
    behaviours: tuple[str, ...]  # one per key
    copies: tuple[int, ...]  # how many times each key is published
    fetch_batch: int
    workers: int  # sync threads (the async driver runs up to 8 at once)
    stop_after: int | None  # effects before a graceful stop(stop_timeout), then drain
    stop_timeout: float

    def keys(self) -> list[str]:
        return [f"k{i}" for i in range(len(self.behaviours))]

    def expected_effects(self) -> Counter[str]:
        return Counter({key: 1 for key, behaviour in zip(self.keys(), self.behaviours,
                                                         strict=True)
                        if behaviour != "reject"})


schedules = st.integers(1, 8).flatmap(lambda keys: st.builds(
    Schedule,
    behaviours=st.tuples(*[st.sampled_from(BEHAVIOURS)] * keys),
    copies=st.tuples(*[st.integers(1, 3)] * keys),
    fetch_batch=st.integers(1, 8),
    workers=st.sampled_from([1, 3]),
    stop_after=st.none() | st.integers(0, 6),
    stop_timeout=st.sampled_from([0.0, 0.02]),
))


@dataclass
class Outcome:
    effects: Counter[str]
    settled: dict[str, str]  # message id -> "ack" | "dead:<error type>"
    nacked: set[str]  # message ids nacked at least once
    pending: int


def run(driver: Driver, schedule: Schedule, *, per_message: bool) -> Outcome:
    """Run ``schedule`` on ``driver`` (batch claims, or per message) to the end."""
    broker = InMemoryBroker()
    for key, copies in zip(schedule.keys(), schedule.copies, strict=True):
        for copy in range(copies):
            broker.publish("orders", {"key": key}, key=key, id=f"{key}#{copy}")
    behaviour = dict(zip(schedule.keys(), schedule.behaviours, strict=True))
    effects: Counter[str] = Counter()
    lock = threading.Lock()
    first_run: set[str] = set()  # keys whose handler ran (started) already

    def body(message: Message) -> Iterator[Sleep | Until]:
        key = message.key or ""
        with lock:
            first = key not in first_run
            first_run.add(key)
        kind = behaviour[key]
        if kind == "reject":
            raise Reject("refused")
        if kind == "fail_once" and first:
            raise NeedRetry(delay=0.5)
        if kind == "brief":
            yield Sleep(0.005)
        if kind == "slow" and first:
            yield Until(lambda: message.acked, timeout=10)  # past its ack deadline
        with lock:
            effects[key] += 1

    slow = "slow" in schedule.behaviours
    # A short lease: a copy told InProgress while another copy runs retries soon (in
    # real time while started by hand; run_until_idle jumps the broker's clock).
    with driver.checker("memory", lease=5) as checker:
        consumer = driver.consumer(
            broker, body, checker, per_message=per_message, workers=schedule.workers,
            fetch_batch=schedule.fetch_batch, max_in_flight=8, retry=RETRY,
            poll_timeout=0.02,
            ack_timeout=0.1 if slow else 900.0)
        if schedule.stop_after is not None:
            consumer.start()
            give_up = time.monotonic() + 2  # then stop wherever it got to
            while (sum(effects.values()) < schedule.stop_after and broker.pending
                   and time.monotonic() < give_up):
                time.sleep(0.001)
            consumer.stop(schedule.stop_timeout)
        consumer.run_until_idle(timeout=60)
    settled = {m.id or "": "ack" for m in broker.acked}
    for letter in broker.dead_letters:
        settled[letter.message.id or ""] = f"dead:{letter.error_type.rsplit('.', 1)[-1]}"
    nacked = {event.message_id or "" for event in broker.history if event.kind == "nack"}
    return Outcome(effects, settled, nacked, broker.pending)


def check(schedule: Schedule, batch: Outcome, plain: Outcome) -> None:
    detail = f"{schedule}\nbatch claims: {batch}\nper message: {plain}"
    expected = schedule.expected_effects()
    assert batch.pending == 0 and plain.pending == 0, detail
    assert plain.effects == expected, detail  # the plain twin itself is right
    assert batch.effects == plain.effects, detail
    assert batch.settled == plain.settled, detail
    for key, behaviour, copies in zip(schedule.keys(), schedule.behaviours,
                                      schedule.copies, strict=True):
        if behaviour == "fail_once" and copies == 1:
            assert f"{key}#0" in batch.nacked and f"{key}#0" in plain.nacked, detail


@pytest.fixture(autouse=True)
def quiet_logs() -> Iterator[None]:
    """Failures, refusals, deadlines and hand-backs are the point: keep logs quiet."""
    logger = logging.getLogger("msgpatterns")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


@settings(max_examples=examples(0.3), deadline=None, database=None, print_blob=True,
          suppress_health_check=list(HealthCheck))
@given(schedule=schedules)
def test_batch_claims_and_per_message_claims_agree(driver: Driver,
                                                   schedule: Schedule) -> None:
    batch = run(driver, schedule, per_message=False)
    plain = run(driver, schedule, per_message=True)
    expected = schedule.expected_effects()
    record_fault(f"claims differential/{driver.name} batch", sum(schedule.copies),
                 int(schedule.stop_after is not None),
                 len(expected - batch.effects), sum((batch.effects - expected).values()))
    record_fault(f"claims differential/{driver.name} per-message", sum(schedule.copies),
                 int(schedule.stop_after is not None),
                 len(expected - plain.effects), sum((plain.effects - expected).values()))
    check(schedule, batch, plain)
