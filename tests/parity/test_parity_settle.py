"""Parity: how a delivery is settled - acks, local and delayed retries (``NeedRetry``),
redeliveries with a durable attempt count, dead letters, decoder errors, explicit acks
and ack deadlines (DESIGN 2, 3, 7) - on both drivers, one test body each."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from msgpatterns import Backoff, InMemoryBroker, Message, NeedRetry, Reject, RetryPolicy
from msgpatterns.errors import AckTimeout
from msgpatterns.testing import EffectLog, assert_all_acked
from two_drivers import Driver, Until

pytestmark = pytest.mark.timeout(60)

SLOW_RETRY = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(60), local_retries=0)


def test_acks_redelivers_and_dead_letters_on_virtual_time(driver: Driver) -> None:
    broker = InMemoryBroker(seed=0)
    broker.publish("t", b"fine")
    broker.publish("t", b"flaky")
    broker.publish("t", b"poison", key="bad")
    done: list[tuple[bytes, int]] = []

    def body(message: Message) -> None:
        if message.raw_body == b"poison" or (message.raw_body == b"flaky"
                                             and message.attempt < 2):
            raise ValueError(f"boom {message.attempt}")
        done.append((message.raw_body, message.attempt))

    consumer = driver.consumer(broker, driver.handler(body), retry=SLOW_RETRY)
    stats = consumer.run_until_idle(timeout=30)  # 60 s backoffs: virtual jumps
    assert sorted(done) == [(b"fine", 1), (b"flaky", 2)]
    [record] = broker.dead_letters
    assert record.attempts == 3 and record.message.key == "bad"
    assert record.reason.startswith("gave up after 3 attempts: ValueError")
    assert record.error_type.endswith("ValueError")
    assert (stats.fetched, stats.acked, stats.failed) == (6, 2, 4)
    assert (stats.redelivered, stats.dead_lettered, stats.released) == (3, 1, 0)
    assert broker.pending == 0


def test_need_retry_without_delay_retries_in_process(driver: Driver) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"x")
    attempts: list[tuple[int, int]] = []

    def body(message: Message) -> None:
        attempts.append((message.attempt, message.local_retries))
        if message.local_retries < 2:
            raise NeedRetry()

    retry = RetryPolicy(local_retries=3, local_backoff=Backoff.fixed(0.001))
    stats = driver.consumer(broker, driver.handler(body), retry=retry).run_until_idle(10)
    assert attempts == [(1, 0), (1, 1), (1, 2)]
    assert (stats.retried_locally, stats.acked, broker.stats.nacks) == (2, 1, 0)


def test_local_retries_used_up_become_a_delayed_retry(driver: Driver) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"x")
    seen: list[tuple[int, int]] = []

    def body(message: Message) -> None:
        seen.append((message.attempt, message.local_retries))
        if message.attempt == 1:
            raise NeedRetry()  # always, on the first delivery

    retry = RetryPolicy(local_retries=2, local_backoff=Backoff.fixed(0.001),
                        backoff=Backoff.fixed(45))
    stats = driver.consumer(broker, driver.handler(body), retry=retry).run_until_idle(10)
    assert seen == [(1, 0), (1, 1), (1, 2), (2, 0)]
    assert (stats.retried_locally, stats.redelivered, stats.acked) == (2, 1, 1)
    assert broker.now() >= 45  # redelivered after the backoff, on virtual time


def test_need_retry_with_a_delay_is_redelivered_after_it(driver: Driver) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"x")
    seen: list[tuple[int, float]] = []

    def body(message: Message) -> None:
        seen.append((message.attempt, broker.now()))
        if message.attempt < 3:
            raise NeedRetry(delay=120, reason="not yet")

    stats = driver.consumer(broker, driver.handler(body)).run_until_idle(10)
    assert [attempt for attempt, _ in seen] == [1, 2, 3]
    assert seen[1][1] - seen[0][1] >= 120 and seen[2][1] - seen[1][1] >= 120
    assert (stats.retried_locally, stats.redelivered, stats.acked) == (0, 2, 1)
    assert broker.stats.nacks == 2 and broker.pending == 0


def test_reject_and_fatal_errors_go_straight_to_dead_letters(driver: Driver) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"reject", id="r")
    broker.publish("t", b"fatal", id="f")
    broker.publish("t", b"ok", id="o")

    def body(message: Message) -> None:
        if message.raw_body == b"reject":
            raise Reject("bad order")
        if message.raw_body == b"fatal":
            raise KeyError("schema")

    retry = RetryPolicy(max_attempts=5, fatal=(KeyError,))
    stats = driver.consumer(broker, driver.handler(body), retry=retry).run_until_idle(10)
    dead = {d.message.id: d for d in broker.dead_letters}
    assert set(dead) == {"r", "f"}
    assert dead["r"].attempts == 1 and "bad order" in dead["r"].reason
    assert dead["f"].attempts == 1 and dead["f"].error_type.endswith("KeyError")
    assert (stats.acked, stats.dead_lettered, stats.redelivered) == (1, 2, 0)


def test_a_decoder_error_is_dead_lettered_and_the_consumer_goes_on(driver: Driver) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"{not json")
    broker.publish("t", b'{"ok": 1}')
    bodies: list[Any] = []

    def body(message: Message) -> None:
        bodies.append(message.body)

    driver.consumer(broker, driver.handler(body), decoder=json.loads).run_until_idle(10)
    assert bodies == [{"ok": 1}]
    [record] = broker.dead_letters
    assert record.error_type.endswith("MalformedMessage") and record.attempts == 1


def test_a_dead_letter_store_of_the_consumers_own_gets_the_record(driver: Driver) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"x", key="k")
    records: list[Any] = []

    class Store:
        def put(self, record: Any) -> None:
            records.append(record)

    def body(message: Message) -> None:
        raise Reject("no")

    stats = driver.consumer(broker, driver.handler(body),
                            dead_letters=Store()).run_until_idle(10)
    [record] = records
    assert record.message.key == "k" and record.reason.endswith("no")
    assert broker.dead_letters == [] and broker.pending == 0  # acked after the store
    assert stats.dead_lettered == 1


def test_explicit_ack_from_another_thread_settles_once(driver: Driver) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"x")
    results: list[bool] = []
    threads: list[threading.Thread] = []

    def ack_twice(message: Message) -> None:
        results.append(message.ack())
        results.append(message.ack())  # settle once: the second is ignored

    def body(message: Message) -> None:
        message.disable_auto_ack()
        threads.append(threading.Thread(target=ack_twice, args=(message,)))
        threads[-1].start()

    stats = driver.consumer(broker, driver.handler(body)).run_until_idle(10)
    threads[0].join()
    assert results == [True, False]
    assert (stats.acked, len(broker.acked), broker.pending) == (1, 1, 0)


def test_an_explicit_ack_with_an_error_is_a_failure(driver: Driver) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"x")
    seen: list[int] = []

    def body(message: Message) -> None:
        seen.append(message.attempt)
        message.disable_auto_ack()
        message.ack(ConnectionError("downstream") if message.attempt == 1 else None)

    stats = driver.consumer(broker, driver.handler(body),
                            retry=SLOW_RETRY).run_until_idle(10)
    assert seen == [1, 2]
    assert (stats.failed, stats.redelivered, stats.acked) == (1, 1, 1)


def test_an_explicit_ack_after_the_handler_raised_is_ignored(driver: Driver) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"x")
    kept: list[Message] = []

    def body(message: Message) -> None:
        message.disable_auto_ack()
        kept.append(message)
        if message.attempt == 1:
            raise ValueError("failed before acking")
        message.ack()

    stats = driver.consumer(broker, driver.handler(body),
                            retry=SLOW_RETRY).run_until_idle(10)
    assert kept[0].ack() is False  # too late: the raise settled it
    assert (stats.failed, stats.redelivered, stats.acked) == (1, 1, 1)


def test_a_message_never_acked_fails_at_its_ack_deadline(driver: Driver) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"x")
    seen: list[int] = []
    late: list[Message] = []

    def body(message: Message) -> None:
        seen.append(message.attempt)
        if message.attempt == 1:
            message.disable_auto_ack()  # and never ack: the deadline fails it
            late.append(message)

    stats = driver.consumer(broker, driver.handler(body), ack_timeout=0.05,
                            retry=SLOW_RETRY).run_until_idle(10)
    assert seen == [1, 2]
    assert isinstance(late[0].ack_error, AckTimeout)
    assert late[0].ack() is False  # a late ack never flips the outcome
    assert (stats.ack_timeouts, stats.failed, stats.redelivered, stats.acked) == (1, 1, 1, 1)
    assert broker.pending == 0


def test_a_handler_still_running_at_its_ack_deadline_is_failed(driver: Driver) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"x")
    first: list[Message] = []
    seen: list[int] = []

    def body(message: Message) -> Any:
        seen.append(message.attempt)
        if message.attempt == 1:
            first.append(message)
            yield Until(lambda: message.acked, timeout=10)  # past its deadline

    stats = driver.consumer(broker, driver.handler(body), ack_timeout=0.1,
                            retry=SLOW_RETRY).run_until_idle(30)
    assert seen == [1, 2] and isinstance(first[0].ack_error, AckTimeout)
    assert (stats.ack_timeouts, stats.redelivered, stats.acked) == (1, 1, 1)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_faults_never_lose_a_message(driver: Driver, seed: int) -> None:
    broker = InMemoryBroker(seed=seed, duplicate_rate=0.2, reorder_window=8,
                            lost_ack_rate=0.2)
    ids = {broker.publish("t", i, key=f"k{i % 5}") for i in range(300)}
    effects = EffectLog()

    def body(message: Message) -> None:
        if hash((message.id, message.attempt)) % 7 == 0:
            raise RuntimeError("flaky downstream")
        effects.record(message.id)

    retry = RetryPolicy(max_attempts=50, backoff=Backoff.exponential(initial=1, max=60))
    driver.consumer(broker, driver.handler(body), workers=3, retry=retry).run_until_idle(60)
    assert_all_acked(broker)
    assert {m.id for m in broker.acked} == ids
    assert broker.stats.duplicates > 0 and broker.stats.lost_acks > 0
    # without idempotency, duplicates and lost acks re-run handlers (at-least-once)
    assert len(effects) > len(ids)


@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit, GeneratorExit])
def test_a_base_exception_from_a_handler_fails_that_message_only(
        driver: Driver, kind: type[BaseException]) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"bad", id="bad")
    broker.publish("t", b"good", id="good")
    seen: list[tuple[bytes, int]] = []

    def body(message: Message) -> None:
        seen.append((message.raw_body, message.attempt))
        if message.raw_body == b"bad":
            raise kind()

    stats = driver.consumer(broker, driver.handler(body),
                            retry=SLOW_RETRY).run_until_idle(10)
    assert sorted(seen) == [(b"bad", 1), (b"bad", 2), (b"bad", 3), (b"good", 1)]
    [record] = broker.dead_letters
    assert record.message.id == "bad" and record.error_type.endswith(kind.__name__)
    assert (stats.acked, stats.dead_lettered) == (1, 1)
