"""Parity: batch handlers (``batch=True``) receive a list of messages and every message
is still settled on its own - retries, dead letters, attempt counts, explicit acks,
idempotency claims - on both drivers, one test body each."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from msgpatterns import Backoff, InMemoryBroker, Message, NeedRetry, Reject, RetryPolicy
from msgpatterns.errors import ConfigurationError, PartialFailure
from msgpatterns.idempotency import MemoryChecker
from msgpatterns.testing import EffectLog, assert_all_acked
from msgpatterns.testing.checker_fixtures import store_params
from two_drivers import Driver, Until, eventually, publish

pytestmark = pytest.mark.timeout(90)

QUICK = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(1.0), local_retries=0)



def consume(driver: Driver, broker: InMemoryBroker, handler: Any, **options: Any) -> Any:
    consumer = driver.consumer(broker, handler, topics=["orders"], group="billing",
                               batch=True, **options)
    consumer.run_until_idle(timeout=60)
    return consumer


def test_the_handler_receives_the_fetched_messages_as_one_list(driver: Driver) -> None:
    broker = InMemoryBroker()
    ids = publish(broker, 10)
    batches: list[list[str | None]] = []

    def body(messages: list[Message]) -> None:
        batches.append([m.id for m in messages])

    consumer = consume(driver, broker, driver.handler(body), fetch_batch=10)
    assert batches == [ids]
    assert consumer.stats.acked == 10 and consumer.stats.fetched == 10
    assert_all_acked(broker)


def test_partial_failures_are_retried_one_by_one_with_their_own_attempt_counts(
        driver: Driver) -> None:
    broker = InMemoryBroker()
    ids = publish(broker, 8)
    calls: list[tuple[str | None, int]] = []

    def body(messages: list[Message]) -> None:
        calls.extend((m.id, m.attempt) for m in messages)
        failures: dict[Message, BaseException] = {}
        for m in messages:
            if m.id in ("o-1", "o-5") and m.attempt == 1:
                failures[m] = ConnectionError("downstream down")
            elif m.id == "o-6" and m.attempt < 3:
                failures[m] = TimeoutError("slow")
        if failures:
            raise PartialFailure(failures)

    consumer = consume(driver, broker, driver.handler(body), retry=RetryPolicy(
        max_attempts=5, backoff=Backoff.fixed(1.0), local_retries=0), fetch_batch=8)
    by_id = Counter(message_id for message_id, _ in calls)
    assert by_id == Counter({**dict.fromkeys(ids, 1), "o-1": 2, "o-5": 2, "o-6": 3})
    assert sorted(a for i, a in calls if i == "o-6") == [1, 2, 3]
    assert consumer.stats.failed == 4 and consumer.stats.redelivered == 4
    assert consumer.stats.acked == 8
    assert_all_acked(broker)


def test_a_handler_that_raises_fails_every_message_of_the_batch(driver: Driver) -> None:
    broker = InMemoryBroker()
    publish(broker, 4)
    attempts: list[int] = []

    def body(messages: list[Message]) -> None:
        attempts.extend(m.attempt for m in messages)
        if messages[0].attempt == 1:
            raise ConnectionError("database down")

    consumer = consume(driver, broker, driver.handler(body), retry=QUICK)
    assert sorted(attempts) == [1] * 4 + [2] * 4
    assert consumer.stats.redelivered == 4 and consumer.stats.acked == 4


def test_dead_letters_are_per_message(driver: Driver) -> None:
    broker = InMemoryBroker()
    ids = publish(broker, 6)

    def body(messages: list[Message]) -> None:
        for m in messages:
            if m.id == "o-2":
                m.ack(Reject("bad order"))  # settled by the handler: straight to DLQ
        poison = [m for m in messages if m.id == "o-4"]
        if poison:
            raise PartialFailure({poison[0]: ValueError("always fails")})

    consumer = consume(driver, broker, driver.handler(body), retry=QUICK)
    dead = {d.message.id: d for d in broker.dead_letters}
    assert set(dead) == {"o-2", "o-4"}
    assert dead["o-2"].attempts == 1 and "bad order" in dead["o-2"].reason
    assert dead["o-4"].attempts == 3 and dead["o-4"].error_type.endswith("ValueError")
    assert consumer.stats.acked == len(ids) - 2


def test_a_partial_failure_naming_a_stranger_is_ignored(driver: Driver) -> None:
    broker = InMemoryBroker()
    publish(broker, 3)
    stranger = Message(b"not in the batch", id="x")

    def body(messages: list[Message]) -> None:
        raise PartialFailure({stranger: ValueError("whose?")})

    consumer = consume(driver, broker, driver.handler(body))
    assert consumer.stats.acked == 3 and consumer.stats.failed == 0


def test_need_retry_without_delay_retries_that_message_in_process(driver: Driver) -> None:
    broker = InMemoryBroker()
    publish(broker, 3)
    seen: list[tuple[str | None, int]] = []

    def body(messages: list[Message]) -> None:
        seen.extend((m.id, m.local_retries) for m in messages)
        for m in messages:
            if m.id == "o-1" and m.local_retries == 0:
                raise PartialFailure({m: NeedRetry()})

    consumer = consume(driver, broker, driver.handler(body),
                       retry=RetryPolicy(local_retries=2))
    assert sorted(seen) == [("o-0", 0), ("o-1", 0), ("o-1", 1), ("o-2", 0)]
    assert consumer.stats.retried_locally == 1 and consumer.stats.acked == 3


def test_max_in_flight_bounds_every_batch(driver: Driver) -> None:
    broker = InMemoryBroker()
    publish(broker, 40)
    sizes: list[int] = []
    in_flight: list[int] = []
    consumer: Any = None

    def body(messages: list[Message]) -> None:
        sizes.append(len(messages))
        in_flight.append(consumer.in_flight)

    consumer = driver.consumer(broker, driver.handler(body), topics=["orders"],
                               group="billing", batch=True, workers=3, max_in_flight=7,
                               fetch_batch=64)
    consumer.run_until_idle(timeout=60)
    assert sum(sizes) == 40
    assert max(sizes) <= 7 and max(in_flight) <= 7


def test_explicit_ack_per_message_in_a_batch(driver: Driver) -> None:
    broker = InMemoryBroker()
    ids = publish(broker, 5)
    parked: list[Message] = []

    def body(messages: list[Message]) -> None:
        for m in messages:
            if m.id == "o-3":
                m.disable_auto_ack()
                parked.append(m)
                threading.Thread(target=m.ack).start()  # acked later, elsewhere

    consumer = consume(driver, broker, driver.handler(body))
    assert [m.id for m in parked] == ["o-3"]
    assert consumer.stats.acked == len(ids)
    assert_all_acked(broker)


def test_ack_deadlines_hold_for_each_message_of_a_batch(driver: Driver) -> None:
    broker = InMemoryBroker()
    publish(broker, 3)
    seen: list[tuple[str | None, int]] = []

    def body(messages: list[Message]) -> None:
        for m in messages:
            seen.append((m.id, m.attempt))
            if m.id == "o-1" and m.attempt == 1:
                m.disable_auto_ack()  # never acked: its deadline fails it alone

    consumer = consume(driver, broker, driver.handler(body), ack_timeout=0.1, retry=QUICK)
    assert sorted(seen) == [("o-0", 1), ("o-1", 1), ("o-1", 2), ("o-2", 1)]
    assert consumer.stats.ack_timeouts == 1 and consumer.stats.acked == 3


def test_stop_hands_back_a_batch_in_progress(driver: Driver) -> None:
    broker = InMemoryBroker()
    ids = publish(broker, 6)
    running = threading.Event()
    release = threading.Event()

    def body(messages: list[Message]) -> Any:
        running.set()
        yield Until(release.is_set, timeout=10)

    consumer = driver.consumer(broker, driver.handler(body), topics=["orders"],
                               group="billing", batch=True)
    consumer.start()
    assert running.wait(10)
    stopper = threading.Thread(target=consumer.stop, args=(0,))
    stopper.start()
    eventually(lambda: broker.in_flight() == 0)  # handed back while it still runs
    release.set()
    stopper.join(10)
    assert not stopper.is_alive()
    assert consumer.stats.released == len(ids) and consumer.stats.acked == 0
    assert consumer.in_flight == 0 and broker.in_flight() == 0
    again: list[str | None] = []  # nothing was acked: every message comes again
    consume(driver, broker, driver.handler(lambda ms: again.extend(m.id for m in ms)))
    assert sorted(again) == ids


def test_a_batch_handler_refuses_ordered_mode_and_a_bad_flag(driver: Driver) -> None:
    handler = driver.handler(lambda ms: None)
    with pytest.raises(ConfigurationError, match="ordered"):
        driver.consumer(InMemoryBroker(), handler, batch=True, ordered=True)
    with pytest.raises(ConfigurationError, match="batch"):
        driver.consumer(InMemoryBroker(), handler, batch="yes")


def test_a_batch_handler_refuses_store_result(driver: Driver) -> None:
    handler = driver.idempotent(MemoryChecker(), lambda ms: None, store_result=True)
    with pytest.raises(ConfigurationError, match="store_result"):
        driver.consumer(InMemoryBroker(), handler, batch=True)


@pytest.mark.parametrize("store", store_params("memory", "redis"))
def test_an_idempotent_batch_handler_gets_only_the_claimed_messages(
        driver: Driver, store: str, tmp_path: Path) -> None:
    broker = InMemoryBroker()
    with driver.checker(store, tmp_path) as checker:
        effects = EffectLog()
        sizes: list[int] = []

        def body(messages: list[Message]) -> None:
            sizes.append(len(messages))
            for m in messages:
                effects.record(m.id)
                if m.id == "o-3" and m.attempt == 1:
                    m.ack(ConnectionError("row lock timeout"))  # released, retried

        handler = driver.idempotent(checker, body, group="billing.batch")
        ids = publish(broker, 6)
        consume(driver, broker, handler, retry=QUICK, fetch_batch=6)
        for message_id in ("o-0", "o-1", "new"):  # two duplicates, one new message
            broker.publish("orders", {"id": message_id}, id=message_id)
        consume(driver, broker, handler, retry=QUICK, fetch_batch=6)
        assert Counter(effects.order) == Counter({**dict.fromkeys(ids, 1), "o-3": 2,
                                                  "new": 1})
        assert sizes == [6, 1, 1]  # the batch, o-3's retry, then only "new"
        assert checker.stats.duplicates == 2 and checker.stats.released == 1
        assert_all_acked(broker)


def test_an_idempotent_batch_handler_cut_by_a_stop_frees_its_keys(driver: Driver) -> None:
    broker = InMemoryBroker()
    checker = MemoryChecker(lease=3600)
    ids = publish(broker, 4)
    running = threading.Event()
    release = threading.Event()
    effects = EffectLog()

    def body(messages: list[Message]) -> Any:
        if messages[0].attempt == 1:
            running.set()
            yield Until(release.is_set, timeout=10)
        for m in messages:
            effects.record(m.id)

    handler = driver.idempotent(checker, body, group="billing.cut")
    consumer = driver.consumer(broker, handler, topics=["orders"], group="billing",
                               batch=True)
    consumer.start()
    assert running.wait(10)
    threading.Timer(0.2, release.set).start()
    consumer.stop(0.05)
    release.set()
    # The handed-back messages run again at once: no key was left PROCESSING (the
    # sync driver's handler returned - its claims were completed, its effects are
    # kept; the async driver's was cancelled - its claims were released).
    consume(driver, broker, handler)
    effects.assert_exactly_once(ids)
    assert_all_acked(broker)
