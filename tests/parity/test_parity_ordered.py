"""Parity: ordered consumption (``ordered=True``, DESIGN 5 and 7) - each key's messages
one at a time in delivery order, a retrying key holds only its own later messages -
and messages without an id (DESIGN 11), on both drivers, one test body each."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import pytest

from msgpatterns import Backoff, InMemoryBroker, Message, NeedRetry, Reject, RetryPolicy
from msgpatterns.testing import assert_all_acked
from two_drivers import Driver, Sleep

pytestmark = pytest.mark.timeout(90)


def _publish_sequences(broker: InMemoryBroker, keys: int, per_key: int) -> None:
    for seq in range(per_key):
        for k in range(keys):
            broker.publish("t", seq, key=f"k{k}")


@pytest.mark.parametrize("workers", [1, 4])
def test_each_key_is_processed_in_order(driver: Driver, workers: int) -> None:
    broker = InMemoryBroker(seed=1)
    _publish_sequences(broker, keys=20, per_key=30)
    seen: dict[str, list[int]] = defaultdict(list)
    active: set[str] = set()
    overlap = []
    lock = threading.Lock()

    def body(message: Message) -> Any:
        with lock:
            if message.key in active:
                overlap.append(message.key)
            active.add(message.key)
        seen[str(message.key)].append(message.body)
        if message.body % 7 == 0:
            yield Sleep(0.001)  # let other keys' handlers run meanwhile
        with lock:
            active.discard(message.key)

    driver.consumer(broker, driver.handler(body), workers=workers, ordered=True,
                    max_in_flight=64).run_until_idle(timeout=30)
    assert overlap == []  # a key never runs twice at once
    assert all(seq == list(range(30)) for seq in seen.values())
    assert len(seen) == 20
    assert_all_acked(broker)


@pytest.mark.parametrize("delay", [None, 30.0])
def test_a_retrying_key_holds_its_later_messages_and_others_go_on(
        driver: Driver, delay: float | None) -> None:
    broker = InMemoryBroker(seed=2)
    _publish_sequences(broker, keys=3, per_key=5)
    order: list[tuple[str, int]] = []
    failures = {"k1": 3}  # k1's first message fails three times

    def body(message: Message) -> None:
        assert message.key is not None
        if message.body == 0 and failures.get(message.key, 0) > 0:
            failures[message.key] -= 1
            raise NeedRetry(delay=delay)
        order.append((message.key, message.body))

    policy = RetryPolicy(local_retries=1, local_backoff=Backoff.fixed(0.001),
                         backoff=Backoff.fixed(60))
    driver.consumer(broker, driver.handler(body), workers=2, ordered=True,
                    retry=policy).run_until_idle(timeout=30)
    for key in ("k0", "k1", "k2"):
        assert [seq for k, seq in order if k == key] == [0, 1, 2, 3, 4]
    # other keys finished while k1 was still retrying its first message
    first_k1 = order.index(("k1", 0))
    assert ("k0", 4) in order[:first_k1]
    assert ("k2", 4) in order[:first_k1]
    assert_all_acked(broker)


def test_ordered_retry_attempts_are_counted_and_dead_letter(driver: Driver) -> None:
    broker = InMemoryBroker()
    broker.publish("t", "poison", key="k")
    broker.publish("t", "next", key="k")
    seen: list[tuple[str, int]] = []

    def body(message: Message) -> None:
        seen.append((message.body, message.attempt))
        if message.body == "poison":
            raise RuntimeError("always fails")

    policy = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(10))
    driver.consumer(broker, driver.handler(body), ordered=True,
                    retry=policy).run_until_idle(timeout=30)
    assert seen == [("poison", 1), ("poison", 2), ("poison", 3), ("next", 1)]
    (dead,) = broker.dead_letters
    assert dead.attempts == 3
    assert broker.pending == 0


class _NoIds:
    """Deliveries without an id, as from a publisher that set none (DESIGN 11)."""

    def __init__(self, inner: InMemoryBroker) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def fetch(self, topics: Sequence[str], group: str, max_messages: int = 1,
              timeout: float = 0.0) -> list[Message]:
        out = self.inner.fetch(topics, group, max_messages, timeout)
        for message in out:
            message.id = None
        return out


@pytest.mark.parametrize("ordered", [False, True])
def test_id_less_messages_are_retried_acked_and_dead_lettered(driver: Driver,
                                                              ordered: bool) -> None:
    """Messages whose id is None go through retries, acks and dead letters like any
    other, in both modes."""
    inner = InMemoryBroker(seed=9)
    for i in range(6):
        inner.publish("t", i, key=None if i % 2 else f"k{i}")
    broker: Any = _NoIds(inner)
    if driver.is_async:
        from msgpatterns.aio import AsyncInMemoryBroker

        broker = AsyncInMemoryBroker(broker)  # the wrapper's sync fake

    def body(message: Message) -> None:
        assert message.id is None
        if message.body == 5:
            raise Reject("five")
        if message.attempt == 1:
            raise NeedRetry(delay=60)

    driver.consumer(broker, driver.handler(body), ordered=ordered,
                    workers=2).run_until_idle(timeout=10)
    assert sorted(m.body for m in inner.acked) == [0, 1, 2, 3, 4]
    (dead,) = inner.dead_letters
    assert dead.id is None and dead.message.body == 5
    assert inner.pending == 0
