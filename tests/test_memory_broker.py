"""InMemoryBroker behaves like a real at-least-once broker (without the consumer)."""

from __future__ import annotations

import threading

import pytest

from msgpatterns import DeadLetter, InMemoryBroker
from msgpatterns.brokers.base import Broker, SupportsVirtualTime


def test_it_is_a_broker_with_virtual_time() -> None:
    broker = InMemoryBroker()
    assert isinstance(broker, Broker)
    assert isinstance(broker, SupportsVirtualTime)


def test_fifo_delivery_and_ack() -> None:
    broker = InMemoryBroker()
    ids = [broker.publish("t", i, key=f"k{i}") for i in range(5)]
    batch = broker.fetch(["t"], "g", max_messages=10)
    assert [m.id for m in batch] == ids
    assert [m.body for m in batch] == list(range(5))
    assert all(m.attempt == 1 for m in batch)
    assert broker.pending == 5 and broker.in_flight("g") == 5
    for m in batch:
        broker.ack(m)
    assert broker.pending == 0
    assert broker.fetch(["t"], "g") == []


def test_each_group_gets_every_message_and_a_topic_nobody_reads_is_pending() -> None:
    broker = InMemoryBroker()
    broker.publish("t", 1)
    assert broker.pending == 1
    a = broker.fetch(["t"], "a")
    b = broker.fetch(["t"], "b")
    assert [m.body for m in a] == [m.body for m in b] == [1]
    broker.ack(a[0])
    assert broker.pending_for("a") == 0 and broker.pending_for("b") == 1


def test_nack_with_delay_is_redelivered_when_due_on_the_virtual_clock() -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"x")
    (m,) = broker.fetch(["t"], "g")
    m.headers["note"] = "failed once"
    broker.nack(m, delay=3600)
    assert broker.fetch(["t"], "g") == []  # not before the delay
    due = broker.next_due(["t"], "g")
    assert due is not None and due - broker.now() == pytest.approx(3600, abs=1)
    broker.advance_to(due)
    (again,) = broker.fetch(["t"], "g")
    assert again.id == m.id and again.attempt == 2
    assert again.headers["note"] == "failed once"  # headers travel with the redelivery


def test_unacked_delivery_times_out_and_comes_back() -> None:
    broker = InMemoryBroker(visibility_timeout=30)
    broker.publish("t", b"x")
    (m,) = broker.fetch(["t"], "g")
    broker.advance(31)
    (again,) = broker.fetch(["t"], "g")
    assert again.attempt == 2 and broker.stats.timeouts == 1
    broker.ack(m)  # the first consumer's late ack still settles the message
    assert broker.pending == 0
    broker.ack(again)
    assert broker.stats.stale_acks == 1 and broker.stats.double_acks == 0


def test_a_late_ack_before_the_redelivery_settles_the_message_for_good() -> None:
    """The visibility timeout put a delivery back; its late ack came before the next
    fetch. The message is settled: the copy put back is not delivered again (it was,
    every ack of it was stale, and it timed out and came back forever - a storm of
    redeliveries found by tests/reliability/test_differential_refill.py)."""
    broker = InMemoryBroker(visibility_timeout=30)
    broker.publish("t", b"x")
    broker.publish("t", b"z")
    x, z = broker.fetch(["t"], "g", max_messages=2)
    broker.advance(31)
    (x_again,) = broker.fetch(["t"], "g", max_messages=1)  # both back in line: x first
    assert x_again.id == x.id and broker.stats.timeouts == 2
    broker.ack(z)  # z's late ack, while z waits in line: it settles z
    broker.ack(x_again)
    assert broker.fetch(["t"], "g", max_messages=10) == []
    assert broker.pending == 0
    assert broker.next_due(["t"], "g") is None


def test_only_unsettled_deliveries_time_out_after_many_settled_ones() -> None:
    # Thousands of settled leases are dropped in bulk along the way; the unsettled
    # deliveries among them keep theirs and come back at their timeout, nothing else.
    broker = InMemoryBroker(visibility_timeout=30, record_history=False)
    for i in range(2000):
        broker.publish("t", i)
    kept = []
    for _ in range(40):
        for m in broker.fetch(["t"], "g", max_messages=50):
            if m.body % 500 == 7:
                kept.append(m)
            elif m.body % 500 == 9:
                broker.nack(m, 60)  # redelivered at 60 s, not at its lease's 30 s
            else:
                broker.ack(m)
    assert [m.body for m in kept] == [7, 507, 1007, 1507]
    broker.advance(31)
    again = broker.fetch(["t"], "g", max_messages=100)
    assert sorted(m.body for m in again) == [7, 507, 1007, 1507]
    assert all(m.attempt == 2 for m in again) and broker.stats.timeouts == 4
    for m in again:
        broker.ack(m)
    broker.advance(30)
    later = broker.fetch(["t"], "g", max_messages=100)
    assert sorted(m.body for m in later) == [9, 509, 1009, 1509]
    assert broker.stats.timeouts == 4


def test_acking_the_same_delivery_twice_is_counted() -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"x")
    (m,) = broker.fetch(["t"], "g")
    broker.ack(m)
    broker.ack(m)
    assert broker.stats.double_acks == 1


def test_lost_acks_are_redelivered() -> None:
    broker = InMemoryBroker(seed=7, lost_ack_rate=0.5, visibility_timeout=10)
    for i in range(200):
        broker.publish("t", i)
    rounds = 0
    while broker.pending:
        rounds += 1
        for m in broker.fetch(["t"], "g", max_messages=500):
            broker.ack(m)
        due = broker.next_due(["t"], "g")
        if due is not None:
            broker.advance_to(due)
    assert broker.stats.lost_acks > 50
    assert rounds > 1
    assert len(broker.acked) == 200


def test_duplicates_are_extra_deliveries_of_the_same_message_and_seeded() -> None:
    def run(seed: int) -> list[str]:
        broker = InMemoryBroker(seed=seed, duplicate_rate=0.3)
        for i in range(100):
            broker.publish("t", i)
        out = []
        while batch := broker.fetch(["t"], "g", max_messages=50):
            for m in batch:
                out.append(m.id)
                broker.ack(m)
        assert broker.pending == 0
        assert len(out) == 100 + broker.stats.duplicates
        return out

    first = run(11)
    assert len(first) > len(set(first)) == 100
    assert run(11) == first  # the same seed replays the same faults


def test_reorder_window_shuffles_locally_but_delivers_everything() -> None:
    broker = InMemoryBroker(seed=5, reorder_window=4)
    for i in range(100):
        broker.publish("t", i)
    out = []
    while batch := broker.fetch(["t"], "g", max_messages=7):
        out.extend(m.body for m in batch)
        for m in batch:
            broker.ack(m)
    assert sorted(out) == list(range(100))
    assert out != list(range(100))
    # an item never moves earlier than the window allows
    assert all(out.index(i) >= i - 3 for i in range(100))


def test_dead_letter_removes_the_message_and_keeps_the_record() -> None:
    broker = InMemoryBroker()
    broker.publish("t", b"x")
    (m,) = broker.fetch(["t"], "g")
    record = DeadLetter.from_error(m, ValueError("bad"), now=broker.now(), group="g")
    broker.dead_letter(m, record)
    assert broker.dead_letters == [record]
    assert broker.pending == 0


def test_blocking_fetch_wakes_on_publish() -> None:
    broker = InMemoryBroker()
    got = []
    waiting = threading.Event()

    def consume() -> None:
        waiting.set()
        got.extend(broker.fetch(["t"], "g", timeout=10))

    thread = threading.Thread(target=consume)
    thread.start()
    waiting.wait(5)
    broker.publish("t", b"late")
    thread.join(10)
    assert [m.body for m in got] == [b"late"]


def test_ack_of_a_foreign_message_is_a_clear_error() -> None:
    from msgpatterns import Message

    with pytest.raises(ValueError, match="not delivered by this InMemoryBroker"):
        InMemoryBroker().ack(Message(b"x"))


def test_bad_fault_rates_are_rejected() -> None:
    with pytest.raises(ValueError, match="duplicate_rate"):
        InMemoryBroker(duplicate_rate=1.5)
    with pytest.raises(ValueError, match="reorder_window"):
        InMemoryBroker(reorder_window=-1)
