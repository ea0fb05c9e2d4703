"""Idempotency, batch claims (claim rounds): they used to apply effects twice (issue 19,
hole 1).

An ``@idempotent`` handler on a lease checker (MemoryChecker, a real Redis), batch claims
on (the default), ``Consumer`` and ``AsyncConsumer``. In one claim round one handler is
slow; the ack deadline or ``stop(timeout)`` used to settle the round's other messages -
whose handlers had returned - by *releasing* their claims (the round completed only when
its last message ended), and they ran again. Now a handler that returned has its claim
completed at once, whatever happens to the rest of its round, and a claim whose handler
is still running stays with that run.

Each scenario is written once (tests/claim_drivers.py) and runs on both drivers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from claim_drivers import STORES, Driver, Sleep, SyncDriver, Until, driver, publish
from msgpatterns import Backoff, Consumer, InMemoryBroker, Message, RetryPolicy
from msgpatterns.idempotency import idempotent
from msgpatterns.testing import EffectLog

__all__ = ["driver"]  # the fixture

pytestmark = pytest.mark.timeout(240)

#: InProgress retries while a slow copy runs count as attempts: never dead-letter on them.
QUICK = RetryPolicy(max_attempts=10_000, backoff=Backoff.fixed(1.0), local_retries=0)


@pytest.fixture(autouse=True)
def quiet_logs() -> Iterator[None]:
    """Deadlines and hand-backs are what these scenarios are about: keep logs to errors."""
    logger = logging.getLogger("msgpatterns")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def _until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait for ``predicate`` (a condition, not a duration); fail after ``timeout``."""
    give_up = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < give_up, "condition not reached"
        time.sleep(0.002)


class FirstDeliveries:
    """The first delivery of each message id that reached the handler."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.first: dict[str, Message] = {}

    def see(self, message: Message) -> bool:
        """Remember ``message``; True when it is its id's first delivery."""
        with self._lock:
            if message.id in self.first:
                return False
            self.first[message.id or ""] = message
            return True

    def settled(self, ids: list[str]) -> bool:
        """Each of ``ids`` was delivered and that first delivery is settled."""
        with self._lock:
            return all(i in self.first and self.first[i].acked for i in ids)


def assert_drained(broker: InMemoryBroker) -> None:
    assert broker.pending == 0
    assert not broker.dead_letters


@pytest.mark.parametrize("store", STORES)
def test_an_ack_deadline_never_reruns_the_returned_handlers_of_a_round_with_a_slow_one(
        driver: Driver, store: str) -> None:
    """Nine messages, one claim round. ``o-0`` is slow: it returns only once every
    other message of the round is settled. Those returned long before; the ack deadline
    used to settle them by releasing their claims (the round waited for ``o-0``), and
    they ran again. Their effects must apply once."""
    broker = InMemoryBroker()
    ids = publish(broker, 9)
    effects = EffectLog()
    deliveries = FirstDeliveries()

    def body(message: Message) -> Iterator[Until]:
        if deliveries.see(message) and message.id == "o-0":
            yield Until(lambda: deliveries.settled(ids[1:]))
        effects.record(message.id)

    with driver.checker(store) as checker:
        consumer = driver.consumer(broker, body, checker, workers=2, fetch_batch=9,
                                   max_in_flight=9, ack_timeout=0.2, retry=QUICK)
        consumer.run_until_idle(timeout=90)
    effects.assert_exactly_once(ids)
    assert_drained(broker)


@pytest.mark.parametrize("store", STORES)
def test_a_handler_that_outlives_its_ack_deadline_keeps_its_claim_until_it_returns(
        driver: Driver, store: str) -> None:
    """``o-0`` of a round runs past its ack deadline: the deadline hands it back, but
    its claim stays with the run (completed when it returns), so its redelivery waits
    (``InProgress``) and is then a duplicate. It used to be released at the deadline,
    and the redelivery ran the handler a second time."""
    broker = InMemoryBroker()
    ids = publish(broker, 3)
    effects = EffectLog()
    deliveries = FirstDeliveries()

    def body(message: Message) -> Iterator[Until]:
        if deliveries.see(message) and message.id == "o-0":
            yield Until(lambda: message.acked)  # settled by its deadline
        effects.record(message.id)

    # Real time here (no virtual jumps): the redelivery comes after the 0.2 s backoff,
    # InProgress retries after the rest of the 3 s lease.
    retry = RetryPolicy(max_attempts=20, backoff=Backoff.fixed(0.2), local_retries=0)
    with driver.checker(store, lease=3) as checker:
        consumer = driver.consumer(broker, body, checker, workers=2, fetch_batch=3,
                                   max_in_flight=3, ack_timeout=0.2, retry=retry)
        consumer.start()
        try:
            _until(lambda: len(effects) >= 3 and broker.pending == 0)
        finally:
            consumer.stop(10)
    effects.assert_exactly_once(ids)
    assert_drained(broker)


@pytest.mark.parametrize("store", STORES)
def test_a_graceful_stop_never_reruns_the_returned_handlers_of_a_round_with_a_slow_one(
        driver: Driver, store: str) -> None:
    """Nine messages, one claim round; ``o-0`` is still running when ``stop(0.05)``
    gives up on it. The eight that returned before the stop are done: draining
    afterwards applies none of them again (and ``o-0`` once in all)."""
    broker = InMemoryBroker()
    ids = publish(broker, 9)
    effects = EffectLog()
    deliveries = FirstDeliveries()
    slow_started = threading.Event()

    def body(message: Message) -> Iterator[Until]:
        first = deliveries.see(message)
        if message.id == "o-0" and first:
            slow_started.set()
            yield Until(lambda: message.acked)  # handed back by the stop
        effects.record(message.id)

    with driver.checker(store) as checker:
        consumer = driver.consumer(broker, body, checker, workers=2, fetch_batch=9,
                                   max_in_flight=9, retry=QUICK)
        consumer.start()
        assert slow_started.wait(30)
        _until(lambda: all(effects.count(i) == 1 for i in ids[1:]))
        assert consumer.stop(0.05) is False  # o-0 was still running: handed back
        consumer.run_until_idle(timeout=90)
    effects.assert_exactly_once(ids)
    assert_drained(broker)


@pytest.mark.parametrize("store", STORES)
def test_graceful_stop_start_cycles_apply_every_effect_exactly_once(
        driver: Driver, store: str) -> None:
    """The issue's scenario: 600 messages, 4 workers, one handler in 20 taking 80 ms,
    five cycles of start, some progress, ``stop(0.02)``; then a drain. 0 doubled (it
    was 281 of 600), 0 lost."""
    broker = InMemoryBroker()
    ids = publish(broker, 600)
    effects = EffectLog()

    def body(message: Message) -> Iterator[Sleep]:
        if int((message.id or "o-0").split("-")[1]) % 20 == 0:
            yield Sleep(0.08)
        effects.record(message.id)

    with driver.checker(store) as checker:
        consumer = driver.consumer(broker, body, checker, workers=4, retry=QUICK)
        for _ in range(5):
            before = len(effects)
            consumer.start()
            _until(lambda before=before: len(effects) >= min(before + 60, len(ids)))
            consumer.stop(0.02)
        consumer.run_until_idle(timeout=120)
    counts = Counter(effects.order)
    doubled = sum(n - 1 for n in counts.values())
    lost = len(set(ids) - counts.keys())
    assert (doubled, lost) == (0, 0), f"doubled {doubled}, lost {lost} of {len(ids)}"
    assert_drained(broker)


@pytest.mark.parametrize("store", STORES)
def test_a_batch_handler_that_outlives_its_ack_deadline_keeps_its_claims(
        store: str) -> None:
    """The same rule for a batch handler (``Consumer(batch=True)``, sync only): the ack
    deadline settles its messages while it runs, their claims stay with the run and
    are completed when it returns; the redeliveries are duplicates. They used to be
    released at the deadline, and the whole batch ran again."""
    broker = InMemoryBroker()
    ids = publish(broker, 4)
    effects = EffectLog()
    runs: list[int] = []
    retry = RetryPolicy(max_attempts=20, backoff=Backoff.fixed(0.2), local_retries=0)
    with SyncDriver().checker(store, lease=3) as checker:

        @idempotent(checker, group="claims.batch")
        def handle(messages: list[Message]) -> None:
            runs.append(len(messages))
            if len(runs) == 1:  # the first run outlives every message's deadline
                _until(lambda: all(m.acked for m in messages))
            for message in messages:
                effects.record(message.id)

        consumer = Consumer(broker, handle, topics=["orders"], group="billing",
                            batch=True, fetch_batch=4, ack_timeout=0.2, retry=retry)
        consumer.start()
        try:
            _until(lambda: len(effects) >= 4 and broker.pending == 0)
        finally:
            consumer.stop(10)
    effects.assert_exactly_once(ids)
    assert runs[0] == 4
    assert_drained(broker)
