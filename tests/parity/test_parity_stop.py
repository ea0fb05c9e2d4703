"""Parity: flow control, ``stop(timeout)``, ``run()`` and ``run_until_idle()`` (DESIGN 7,
11 lifecycle) on both drivers, one test body each."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from msgpatterns import Backoff, InMemoryBroker, Message, NeedRetry, RetryPolicy
from msgpatterns.testing import EffectLog, assert_all_acked
from two_drivers import DIFFERENCES, Do, Driver, Until, eventually

pytestmark = pytest.mark.timeout(90)


def test_max_in_flight_is_never_exceeded(driver: Driver) -> None:
    broker = InMemoryBroker()
    for i in range(200):
        broker.publish("t", i)
    peak = 0
    lock = threading.Lock()
    pending: list[Message] = []

    def body(message: Message) -> None:
        nonlocal peak
        message.disable_auto_ack()
        with lock:
            peak = max(peak, broker.in_flight("g"))
            pending.append(message)
            burst = pending[:] if len(pending) >= 5 else []
            if burst:
                pending.clear()
        for m in burst:  # settle in bursts, from the handler
            m.ack()

    done = threading.Event()

    def flush_stragglers() -> None:
        while not done.wait(0.01):
            with lock:
                burst = pending[:]
                pending.clear()
            for m in burst:
                m.ack()

    acker = threading.Thread(target=flush_stragglers)
    acker.start()
    try:
        driver.consumer(broker, driver.handler(body), max_in_flight=7).run_until_idle(30)
    finally:
        done.set()
        acker.join()
    assert 0 < peak <= 7
    assert_all_acked(broker)


def test_handlers_run_concurrently(driver: Driver) -> None:
    broker = InMemoryBroker()
    for i in range(4):
        broker.publish("t", i)
    running = 0
    lock = threading.Lock()

    def body(message: Message) -> Any:
        nonlocal running
        with lock:
            running += 1
        yield Until(lambda: running >= 4, timeout=10)  # only if 4 run at once

    stats = driver.consumer(broker, driver.handler(body), workers=4).run_until_idle(30)
    assert running == 4 and stats.acked == 4


def test_stop_under_load_loses_nothing(driver: Driver) -> None:
    broker = InMemoryBroker(seed=3)
    total = 1000
    for i in range(total):
        broker.publish("t", i, key=str(i % 17))
    effects = EffectLog()
    release = threading.Event()

    def body(message: Message) -> Any:
        effects.record(message.id)
        if len(effects) >= total // 3:  # from here on, handlers are busy until the stop
            yield Until(release.is_set, timeout=10)

    first = driver.consumer(broker, driver.handler(body), max_in_flight=64)
    first.start()
    eventually(lambda: len(effects) >= total // 3)
    release_later = threading.Timer(0.2, release.set)
    release_later.start()
    first.stop(timeout=0)  # hand back whatever is still in flight, right now
    release_later.join()
    acked = {m.id for m in broker.acked}
    assert len(acked) + broker.pending == total  # every message is acked or pending
    assert 0 < len(acked) < total
    assert broker.in_flight() == 0

    driver.consumer(broker, driver.handler(lambda m: None)).run_until_idle(60)
    assert_all_acked(broker)


def test_stop_hands_back_a_message_whose_handler_is_stuck(driver: Driver) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"slow")
    entered = threading.Event()
    release = threading.Event()
    after_stop = threading.Event()
    late: list[int] = []

    def body(message: Message) -> Any:
        entered.set()
        yield Until(release.is_set, timeout=10)
        if after_stop.is_set():
            late.append(message.attempt)

    consumer = driver.consumer(broker, driver.handler(body), poll_timeout=0.05)
    consumer.start()
    assert entered.wait(10)
    threading.Timer(1.0, release.set).start()
    assert consumer.stop(timeout=0.05) is False  # did not finish in time
    after_stop.set()
    assert broker.in_flight() == 0 and broker.pending == 1  # handed back
    assert consumer.stats.released == 1 and consumer.in_flight == 0
    release.set()
    time.sleep(0.1)
    assert late == []  # no handler of the stopped consumer ran on after stop()

    done: list[int] = []
    driver.consumer(broker, driver.handler(lambda m: done.append(m.attempt))) \
        .run_until_idle(10)
    assert done == [2]
    assert_all_acked(broker)


def test_stop_returns_within_its_timeout_while_a_handler_never_returns(
        driver: Driver, request: pytest.FixtureRequest) -> None:
    if not driver.is_async:
        request.applymarker(pytest.mark.xfail(
            strict=True, reason=f"a thread cannot be cancelled: stop() waits for the "
                                f"running handler ({DIFFERENCES})"))
    broker = InMemoryBroker()
    broker.publish("t", b"stuck")
    entered = threading.Event()
    release = threading.Event()

    def body(message: Message) -> Any:
        entered.set()
        yield Until(release.is_set, timeout=2)

    consumer = driver.consumer(broker, driver.handler(body))
    consumer.start()
    assert entered.wait(10)
    started = time.monotonic()
    try:
        assert consumer.stop(timeout=0.05) is False
        took = time.monotonic() - started
    finally:
        release.set()
    assert took < 1.0, f"stop(0.05) took {took:.2f}s"


def test_stop_waits_for_in_flight_work_to_finish(driver: Driver) -> None:
    broker = InMemoryBroker()
    for i in range(10):
        broker.publish("t", i)
    entered = threading.Event()
    release = threading.Event()

    def body(message: Message) -> Any:
        entered.set()
        yield Until(release.is_set, timeout=10)

    consumer = driver.consumer(broker, driver.handler(body), workers=2, max_in_flight=4)
    consumer.start()
    assert entered.wait(10)
    threading.Timer(0.05, release.set).start()
    assert consumer.stop(timeout=30) is True
    # every message it had fetched was finished; the rest were never fetched
    assert len(broker.acked) + broker.pending == 10 and len(broker.acked) >= 1
    assert broker.in_flight() == 0 and consumer.stats.released == 0


def test_a_local_retry_waiting_at_the_stop_goes_back_to_the_broker(driver: Driver) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"x")
    tried = threading.Event()

    def body(message: Message) -> None:
        tried.set()
        raise NeedRetry()

    policy = RetryPolicy(local_backoff=Backoff.fixed(60))  # a long local wait
    consumer = driver.consumer(broker, driver.handler(body), retry=policy)
    consumer.start()
    assert tried.wait(10)
    eventually(lambda: consumer.stats.retried_locally == 1)
    consumer.stop(timeout=0.05)
    assert broker.pending == 1 and broker.in_flight() == 0
    driver.consumer(broker, driver.handler(lambda m: None)).run_until_idle(10)
    assert_all_acked(broker)


def test_stop_from_a_handler_requests_it_and_run_returns(driver: Driver) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"x")
    answers: list[Any] = []
    consumer: Any = None

    def body(message: Message) -> Any:
        yield Do(lambda: consumer.consumer.stop(), answers)

    consumer = driver.consumer(broker, driver.handler(body), poll_timeout=0.05)
    consumer.run()  # returns once the stop the handler asked for is done
    assert answers == [False]  # it cannot wait for itself
    assert consumer.stats.acked == 1 and broker.pending == 0


def test_run_until_idle_raises_when_never_idle_and_hands_back(driver: Driver) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"x")

    def body(message: Message) -> None:
        message.disable_auto_ack()  # never acked (the deadline is far)

    consumer = driver.consumer(broker, driver.handler(body), ack_timeout=60)
    with pytest.raises(TimeoutError, match="not idle"):
        consumer.run_until_idle(timeout=0.3)
    assert broker.pending == 1 and broker.in_flight() == 0  # handed back


def test_run_until_idle_can_be_called_again(driver: Driver) -> None:
    broker = InMemoryBroker()
    seen: list[int] = []
    consumer = driver.consumer(broker, driver.handler(lambda m: seen.append(m.body)))
    broker.publish("t", 1)
    consumer.run_until_idle(10)
    broker.publish("t", 2)
    consumer.run_until_idle(10)
    assert seen == [1, 2]


def test_groups_each_get_every_message(driver: Driver) -> None:
    broker = InMemoryBroker()
    for i in range(20):
        broker.publish("t", i)
    seen: dict[str, list[int]] = {"a": [], "b": []}
    for group in seen:
        handler = driver.handler(lambda m, g=group: seen[g].append(m.body))
        driver.consumer(broker, handler, group=group, workers=1).run_until_idle(10)
    assert sorted(seen["a"]) == sorted(seen["b"]) == list(range(20))
