"""DESIGN 7: flow control, worker pool, stop without loss, SIGTERM, run_until_idle,
and exactly-once settlement under injected broker faults."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Sequence
from typing import Any

import pytest

from msgpatterns import (
    Backoff,
    Consumer,
    InMemoryBroker,
    Message,
    NeedRetry,
    Reject,
    RetryPolicy,
)
from msgpatterns.testing import EffectLog, assert_all_acked


def test_max_in_flight_is_never_exceeded(fake_broker: InMemoryBroker) -> None:
    for i in range(200):
        fake_broker.publish("t", i)
    peak = 0
    lock = threading.Lock()
    pending: list[Message] = []

    def handler(message: Message) -> None:
        nonlocal peak
        message.disable_auto_ack()
        with lock:
            peak = max(peak, fake_broker.in_flight("g"))
            pending.append(message)
            if len(pending) >= 5:  # settle in bursts, from the handler thread
                batch = pending[:]
                pending.clear()
            else:
                batch = []
        for m in batch:
            m.ack()

    acker_stop = threading.Event()

    def flush_stragglers() -> None:
        while not acker_stop.wait(0.01):
            with lock:
                batch = pending[:]
                pending.clear()
            for m in batch:
                m.ack()

    acker = threading.Thread(target=flush_stragglers)
    acker.start()
    consumer = Consumer(fake_broker, handler, topics=["t"], group="g", workers=4, max_in_flight=7)
    try:
        consumer.run_until_idle(timeout=30)
    finally:
        acker_stop.set()
        acker.join()
    assert 0 < peak <= 7
    assert_all_acked(fake_broker)


def test_workers_run_handlers_concurrently(fake_broker: InMemoryBroker) -> None:
    for i in range(4):
        fake_broker.publish("t", i)
    barrier = threading.Barrier(4, timeout=10)  # breaks unless 4 handlers run at once
    Consumer(
        fake_broker, lambda m: barrier.wait(), topics=["t"], group="g", workers=4
    ).run_until_idle(timeout=20)
    assert_all_acked(fake_broker)


def test_stop_under_load_with_four_workers_loses_nothing() -> None:
    broker = InMemoryBroker(seed=3)
    total = 3000
    for i in range(total):
        broker.publish("t", i, key=str(i % 17))
    effects = EffectLog()
    halfway = threading.Event()
    stopped = threading.Event()

    def handler(message: Message) -> None:
        effects.record(message.id)
        if len(effects) >= total // 3:  # from here on, handlers are busy until the stop
            halfway.set()
            stopped.wait(10)

    first = Consumer(broker, handler, topics=["t"], group="g", workers=4, max_in_flight=64)
    first.start()
    assert halfway.wait(30)
    first.stop(timeout=0)  # hand back whatever is still in flight, right now
    stopped.set()
    acked = {m.id for m in broker.acked}
    assert len(acked) + broker.pending == total  # every message is acked or pending
    assert 0 < len(acked) < total

    second = Consumer(broker, handler, topics=["t"], group="g", workers=4)
    second.run_until_idle(timeout=60)
    assert_all_acked(broker)


def test_stop_hands_back_a_message_whose_handler_is_stuck(fake_broker: InMemoryBroker) -> None:
    fake_broker.publish("t", b"slow")
    entered = threading.Event()
    release = threading.Event()

    def stuck(message: Message) -> None:
        entered.set()
        release.wait(10)

    consumer = Consumer(fake_broker, stuck, topics=["t"], group="g")
    consumer.start()
    assert entered.wait(10)
    assert consumer.stop(timeout=0.05) is False  # did not finish in time
    assert fake_broker.in_flight() == 0 and fake_broker.pending == 1
    release.set()

    done: list[Message] = []
    Consumer(fake_broker, done.append, topics=["t"], group="g").run_until_idle(timeout=10)
    assert [m.attempt for m in done] == [2]
    assert_all_acked(fake_broker)


def test_stop_waits_for_in_flight_work_to_finish(fake_broker: InMemoryBroker) -> None:
    for i in range(10):
        fake_broker.publish("t", i)
    entered = threading.Event()
    release = threading.Event()

    def handler(message: Message) -> None:
        entered.set()
        release.wait(10)

    consumer = Consumer(fake_broker, handler, topics=["t"], group="g", workers=2)
    consumer.start()
    assert entered.wait(10)
    threading.Timer(0.05, release.set).start()
    assert consumer.stop(timeout=30) is True
    # every message it had fetched was finished; the rest were never fetched
    assert len(fake_broker.acked) + fake_broker.pending == 10
    assert fake_broker.in_flight() == 0


def test_local_retry_waiting_at_stop_goes_back_to_the_broker(fake_broker: InMemoryBroker) -> None:
    fake_broker.publish("t", b"x")
    tried = threading.Event()

    def handler(message: Message) -> None:
        tried.set()
        raise NeedRetry()

    policy = RetryPolicy(local_backoff=Backoff.fixed(60))  # a long local wait
    consumer = Consumer(fake_broker, handler, topics=["t"], group="g", retry=policy)
    consumer.start()
    assert tried.wait(10)
    consumer.stop(timeout=0.05)
    assert fake_broker.pending == 1 and fake_broker.in_flight() == 0
    Consumer(fake_broker, lambda m: None, topics=["t"], group="g").run_until_idle(timeout=10)
    assert_all_acked(fake_broker)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_faults_never_lose_a_message(seed: int) -> None:
    broker = InMemoryBroker(seed=seed, duplicate_rate=0.2, reorder_window=8, lost_ack_rate=0.2)
    ids = {broker.publish("t", i, key=f"k{i % 5}") for i in range(300)}
    effects = EffectLog()

    def flaky(message: Message) -> None:
        if hash((message.id, message.attempt)) % 7 == 0:
            raise RuntimeError("flaky downstream")
        effects.record(message.id)

    policy = RetryPolicy(max_attempts=50, backoff=Backoff.exponential(initial=1, max=60))
    consumer = Consumer(broker, flaky, topics=["t"], group="g", workers=3, retry=policy)
    consumer.run_until_idle(timeout=60)
    assert_all_acked(broker)
    assert {m.id for m in broker.acked} == ids
    assert broker.stats.duplicates > 0 and broker.stats.lost_acks > 0
    # without idempotency, duplicates and lost acks re-run handlers (at-least-once)
    assert len(effects) > len(ids)


def test_run_until_idle_raises_when_never_idle(fake_broker: InMemoryBroker) -> None:
    fake_broker.publish("t", b"x")
    consumer = Consumer(
        fake_broker, lambda m: m.disable_auto_ack(), topics=["t"], group="g", ack_timeout=60
    )
    with pytest.raises(TimeoutError, match="not idle"):
        consumer.run_until_idle(timeout=0.2)
    assert fake_broker.pending == 1 and fake_broker.in_flight() == 0  # handed back


def test_run_until_idle_can_be_called_again(fake_broker: InMemoryBroker) -> None:
    seen: list[int] = []
    consumer = Consumer(fake_broker, lambda m: seen.append(m.body), topics=["t"], group="g")
    fake_broker.publish("t", 1)
    consumer.run_until_idle(timeout=10)
    fake_broker.publish("t", 2)
    consumer.run_until_idle(timeout=10)
    assert seen == [1, 2]


def test_groups_each_get_every_message(fake_broker: InMemoryBroker) -> None:
    for i in range(20):
        fake_broker.publish("t", i)
    seen: dict[str, list[int]] = {"a": [], "b": []}
    for group in seen:
        Consumer(
            fake_broker, lambda m, g=group: seen[g].append(m.body), topics=["t"], group=group
        ).run_until_idle(timeout=10)
    assert seen["a"] == seen["b"] == list(range(20))


SIGTERM_SCRIPT = textwrap.dedent(
    """
    import json, sys, threading
    from msgpatterns import Consumer, InMemoryBroker

    broker = InMemoryBroker(seed=0)
    for i in range(5000):
        broker.publish("t", i)
    started = threading.Event()

    def handler(message):
        if not started.is_set():
            started.set()
            print("READY", flush=True)

    consumer = Consumer(broker, handler, topics=["t"], group="g", workers=4,
                        max_in_flight=64)
    consumer.run()  # returns after SIGTERM, once in-flight work is settled
    print(json.dumps({"acked": len({m.id for m in broker.acked}),
                      "pending": broker.pending, "in_flight": broker.in_flight()}))
    """
)


def test_sigterm_stops_run_gracefully() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_SCRIPT], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "READY"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["in_flight"] == 0
    assert summary["acked"] + summary["pending"] == 5000
    assert summary["acked"] > 0


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
def test_id_less_messages_are_retried_acked_and_dead_lettered(ordered: bool) -> None:
    """DESIGN 11 (identity): messages whose id is None go through retries, acks and
    dead letters like any other, in both modes."""
    inner = InMemoryBroker(seed=9)
    for i in range(6):
        inner.publish("t", i, key=None if i % 2 else f"k{i}")
    broker = _NoIds(inner)

    def handler(message: Message) -> None:
        assert message.id is None
        if message.body == 5:
            raise Reject("five")
        if message.attempt == 1:
            raise NeedRetry(delay=60)

    Consumer(broker, handler, topics=["t"], group="g", ordered=ordered,
             workers=2).run_until_idle(timeout=5)
    assert sorted(m.body for m in inner.acked) == [0, 1, 2, 3, 4]
    (dead,) = inner.dead_letters
    assert dead.id is None and dead.message.body == 5
    assert inner.pending == 0
