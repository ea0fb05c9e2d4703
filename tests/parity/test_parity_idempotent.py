"""Parity: ``@idempotent`` handlers (DESIGN 4) - a redelivered or duplicated message
runs its handler once, a failed run frees its key for the retry - on both drivers, one
test body each, on the in-process store and on a real Redis."""

from __future__ import annotations

from pathlib import Path

import pytest

from msgpatterns import Backoff, InMemoryBroker, Message, RetryPolicy
from msgpatterns.testing import EffectLog, assert_all_acked
from msgpatterns.testing.checker_fixtures import store_params
from two_drivers import Driver

pytestmark = pytest.mark.timeout(90)

STORES = store_params("memory", "redis")
QUICK = RetryPolicy(max_attempts=5, backoff=Backoff.fixed(1.0), local_retries=0)


@pytest.mark.parametrize("store", STORES)
def test_duplicates_from_the_broker_run_the_handler_once(driver: Driver, store: str,
                                                         tmp_path: Path) -> None:
    broker = InMemoryBroker(seed=7, duplicate_rate=0.4, lost_ack_rate=0.2)
    ids = [broker.publish("t", i, key=f"k{i}") for i in range(60)]
    effects = EffectLog()
    with driver.checker(store, tmp_path) as checker:
        handler = driver.idempotent(checker, lambda m: effects.record(m.key))
        stats = driver.consumer(broker, handler, retry=QUICK).run_until_idle(60)
        assert broker.stats.duplicates > 0 and broker.stats.lost_acks > 0
        effects.assert_exactly_once(f"k{i}" for i in range(len(ids)))
        assert checker.stats.duplicates > 0
        # a duplicate that arrives while its original runs is InProgress: retried later
        assert stats.acked >= len(ids) and stats.failed == stats.redelivered
        assert stats.dead_lettered == 0
    assert_all_acked(broker)


@pytest.mark.parametrize("store", STORES)
def test_a_failed_run_frees_its_key_and_the_retry_runs(driver: Driver, store: str,
                                                       tmp_path: Path) -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"x", key="order-1")
    runs: list[int] = []
    effects = EffectLog()

    def body(message: Message) -> None:
        runs.append(message.attempt)
        if message.attempt == 1:
            raise ConnectionError("downstream down")
        effects.record(message.key)

    with driver.checker(store, tmp_path) as checker:
        handler = driver.idempotent(checker, body)
        stats = driver.consumer(broker, handler, retry=QUICK).run_until_idle(30)
        assert runs == [1, 2]
        assert checker.stats.released == 1 and checker.stats.completed == 1
        assert (stats.failed, stats.redelivered, stats.acked) == (1, 1, 1)
    effects.assert_exactly_once(["order-1"])


@pytest.mark.parametrize("store", STORES)
def test_a_message_published_again_after_it_was_done_is_acked_unrun(
        driver: Driver, store: str, tmp_path: Path) -> None:
    broker = InMemoryBroker()
    effects = EffectLog()
    with driver.checker(store, tmp_path) as checker:
        handler = driver.idempotent(checker, lambda m: effects.record(m.key))
        for round_ in range(2):
            for i in range(5):
                broker.publish("t", round_, key=f"k{i}")  # the same keys, twice
            stats = driver.consumer(broker, handler).run_until_idle(30)
            assert stats.acked == 5
        assert checker.stats.duplicates == 5
    effects.assert_exactly_once(f"k{i}" for i in range(5))
    assert len(broker.acked) == 10
