"""Consumer(ordered=True): per-key order, also while a key is retrying."""

from __future__ import annotations

import threading
from collections import defaultdict

import pytest

from msgpatterns import Backoff, Consumer, InMemoryBroker, Message, NeedRetry, RetryPolicy
from msgpatterns.testing import assert_all_acked


def _publish_sequences(broker: InMemoryBroker, keys: int, per_key: int) -> None:
    for seq in range(per_key):
        for k in range(keys):
            broker.publish("t", seq, key=f"k{k}")


@pytest.mark.parametrize("workers", [1, 4])
def test_each_key_is_processed_in_order(workers: int) -> None:
    broker = InMemoryBroker(seed=1)
    _publish_sequences(broker, keys=20, per_key=30)
    seen: dict[str, list[int]] = defaultdict(list)
    active: set[str] = set()
    overlap = []
    lock = threading.Lock()

    def handler(message: Message) -> None:
        with lock:
            if message.key in active:
                overlap.append(message.key)
            active.add(message.key)
        seen[message.key].append(message.body)
        with lock:
            active.discard(message.key)

    Consumer(broker, handler, topics=["t"], group="g", workers=workers, ordered=True,
             max_in_flight=64).run_until_idle(timeout=30)
    assert overlap == []  # a key never runs on two workers at once
    assert all(seq == list(range(30)) for seq in seen.values())
    assert len(seen) == 20
    assert_all_acked(broker)


@pytest.mark.parametrize("delay", [None, 30.0])
def test_a_retrying_key_holds_its_later_messages_and_others_go_on(delay: float | None) -> None:
    broker = InMemoryBroker(seed=2)
    _publish_sequences(broker, keys=3, per_key=5)
    order: list[tuple[str, int]] = []
    failures = {"k1": 3}  # k1's first message fails three times

    def handler(message: Message) -> None:
        assert message.key is not None
        if message.body == 0 and failures.get(message.key, 0) > 0:
            failures[message.key] -= 1
            raise NeedRetry(delay=delay)
        order.append((message.key, message.body))

    policy = RetryPolicy(local_retries=1, local_backoff=Backoff.fixed(0.001),
                         backoff=Backoff.fixed(60))
    Consumer(broker, handler, topics=["t"], group="g", workers=2, ordered=True,
             retry=policy).run_until_idle(timeout=30)

    for key in ("k0", "k1", "k2"):
        assert [seq for k, seq in order if k == key] == [0, 1, 2, 3, 4]
    # other keys finished while k1 was still retrying its first message
    first_k1 = order.index(("k1", 0))
    assert ("k0", 4) in order[:first_k1]
    assert ("k2", 4) in order[:first_k1]
    assert_all_acked(broker)


def test_ordered_retry_attempts_are_counted_and_dead_letter() -> None:
    broker = InMemoryBroker()
    broker.publish("t", "poison", key="k")
    broker.publish("t", "next", key="k")
    seen: list[tuple[str, int]] = []

    def handler(message: Message) -> None:
        seen.append((message.body, message.attempt))
        if message.body == "poison":
            raise RuntimeError("always fails")

    policy = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(10))
    Consumer(broker, handler, topics=["t"], group="g", ordered=True,
             retry=policy).run_until_idle(timeout=30)
    assert seen == [("poison", 1), ("poison", 2), ("poison", 3), ("next", 1)]
    (dead,) = broker.dead_letters
    assert dead.attempts == 3
    assert broker.pending == 0
