"""RabbitMQBroker specifics on the real server: reconnect after the server closes the
connection, a killed consumer process, acks from many threads, prefetch, retry delay
buckets, and publishing where nobody listens."""

from __future__ import annotations

import shutil
import subprocess
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker_harness import (
    delete_rabbitmq_topology,
    drain,
    eventually,
    require_library,
    sigkill_while_holding,
)
from msgpatterns import Consumer, Message

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(60)]


@pytest.fixture
def rabbitmq_url(rabbitmq_url: str) -> str:
    require_library("pika", "RabbitMQBroker")
    return rabbitmq_url


@pytest.fixture
def names(rabbitmq_url: str, unique: str) -> Iterator[tuple[str, str]]:
    topic, group = f"rt-{unique}", f"g-{unique}"
    yield topic, group
    delete_rabbitmq_topology(rabbitmq_url, topic, group)


@pytest.fixture
def brokers() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for broker in made:
        broker.close()


def make(url: str, made: list[Any], **kwargs: Any) -> Any:
    from msgpatterns.brokers import RabbitMQBroker

    broker = RabbitMQBroker(url, **kwargs)
    made.append(broker)
    return broker


def close_from_server(connection_name: str) -> None:
    """Close our connection from the server side (only ours: the server is shared)."""
    listing = subprocess.run(
        ["rabbitmqctl", "list_connections", "pid", "client_properties", "-q"],
        capture_output=True, text=True, check=True, timeout=30,
    )
    for line in listing.stdout.splitlines():
        pid, _, props = line.partition("\t")
        if f'{{"connection_name","{connection_name}"}}' in props:
            subprocess.run(["rabbitmqctl", "close_connection", pid, "test: forced close"],
                           capture_output=True, check=True, timeout=30)
            return
    raise AssertionError(f"no connection named {connection_name}")


# -- pure ---------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=0.0005, max_value=7200.0, allow_nan=False))
def test_retry_delay_buckets_are_never_early_and_at_most_ten_percent_late(delay: float) -> None:
    require_library("pika", "RabbitMQBroker")
    from msgpatterns.brokers.rabbitmq import delay_bucket_ms

    bucket = delay_bucket_ms(delay)
    assert bucket >= delay * 1000
    assert bucket <= max(delay * 1000 * 1.1, delay * 1000 + 1)
    assert len(str(bucket).rstrip("0")) <= 2  # two significant digits: few queues


# -- on the server ------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("rabbitmqctl") is None, reason="needs rabbitmqctl")
def test_reconnects_after_the_server_closes_the_connection(
    rabbitmq_url: str, names: tuple[str, str], brokers: list[Any]
) -> None:
    topic, group = names
    broker = make(rabbitmq_url, brokers, name=f"msgpatterns-test-{uuid.uuid4().hex[:8]}")
    broker.subscribe(topic, group)
    broker.publish(topic, b"in flight")
    [held] = drain(broker, topic, group, count=1)
    close_from_server(broker.name)
    # The delivery died with the connection: the server requeues it, the broker
    # reconnects and consumes again, and the late ack of the dead delivery is dropped.
    broker.ack(held)
    [again] = drain(broker, topic, group, count=1, within=20)
    assert again.raw_body == b"in flight"
    assert again.attempt == 2  # the quorum queue counted the lost delivery
    broker.ack(again)
    broker.publish(topic, b"after")  # publishing works on the new connection too
    [after] = drain(broker, topic, group, count=1, within=10)
    assert after.raw_body == b"after" and after.attempt == 1
    broker.ack(after)


def test_a_killed_consumer_process_hands_its_deliveries_to_the_next(
    rabbitmq_url: str, names: tuple[str, str], brokers: list[Any]
) -> None:
    topic, group = names
    broker = make(rabbitmq_url, brokers)
    broker.subscribe(topic, group)
    for i in range(5):
        broker.publish(topic, f"m{i}".encode())
    sigkill_while_holding(f"RabbitMQBroker({rabbitmq_url!r})", topic, group, 5)
    got = drain(broker, topic, group, count=5, within=20)
    assert sorted(m.raw_body for m in got) == [f"m{i}".encode() for i in range(5)]
    assert {m.attempt for m in got} == {2}
    for m in got:
        broker.ack(m)


def test_a_queue_a_fetch_no_longer_asks_for_hands_back_its_prefetch_in_order(
    rabbitmq_url: str, names: tuple[str, str], unique: str, brokers: list[Any]
) -> None:
    """An ordered topic's partition moves to another consumer: the old one's next
    fetch (of its other queues) hands back what the server had pushed it of the
    moved queue, oldest first and ahead of newer messages, and stops consuming it."""
    topic, group = names
    other = f"rt-other-{unique}"
    first = make(rabbitmq_url, brokers, prefetch=10)
    first.subscribe(topic, group)
    first.subscribe(other, group)
    try:
        for i in range(4):
            first.publish(topic, f"m{i}".encode())
        [head] = drain(first, topic, group, count=1, within=10)  # m1..m3 prefetched
        assert head.raw_body == b"m0"
        first.ack(head)
        assert first.fetch([other], group, max_messages=10, timeout=0.1) == []
        for i in range(4, 6):
            first.publish(topic, f"m{i}".encode())
        second = make(rabbitmq_url, brokers, prefetch=10)
        got = drain(second, topic, group, count=5, within=10)
        assert [m.raw_body for m in got] == [f"m{i}".encode() for i in range(1, 6)]
        # a quorum queue counts the return of m1..m3 as a delivery (as after a crash)
        assert [m.attempt for m in got] == [2, 2, 2, 1, 1]
        for m in got:
            second.ack(m)
        assert first.fetch([other], group, max_messages=10, timeout=0.3) == []
    finally:
        delete_rabbitmq_topology(rabbitmq_url, other, group)


def test_release_hands_back_the_prefetch_of_a_topic_without_another_fetch(
    rabbitmq_url: str, names: tuple[str, str], brokers: list[Any]
) -> None:
    """A member that holds no partition any more fetches nothing: ``release`` lets go
    of the topic, its prefetch goes back in order; a later fetch consumes it again."""
    topic, group = names
    first = make(rabbitmq_url, brokers, prefetch=10)
    first.subscribe(topic, group)
    for i in range(4):
        first.publish(topic, f"m{i}".encode())
    [head] = drain(first, topic, group, count=1, within=10)
    first.release([topic], group)
    first.release([topic], group)  # idempotent
    second = make(rabbitmq_url, brokers, prefetch=10)
    got = drain(second, topic, group, count=3, within=10)
    assert [m.raw_body for m in got] == [b"m1", b"m2", b"m3"]
    first.ack(head)  # a delivery a fetch returned is still this broker's to settle
    for m in got:
        second.nack(m)  # back to the queue's end, for the first broker to fetch again
    second.close()
    again = drain(first, topic, group, count=3, within=10)
    assert sorted(m.raw_body for m in again) == [b"m1", b"m2", b"m3"]
    for m in again:
        first.ack(m)


def test_acks_from_many_threads_settle_every_delivery_once(
    rabbitmq_url: str, names: tuple[str, str], brokers: list[Any]
) -> None:
    topic, group = names
    broker = make(rabbitmq_url, brokers, prefetch=64)
    broker.subscribe(topic, group)
    total = 300
    for i in range(total):
        broker.publish(topic, str(i).encode())
    seen: list[Message] = []
    lock = threading.Lock()

    def handler(message: Message) -> None:
        with lock:
            seen.append(message)

    consumer = Consumer(broker, handler, topics=[topic], group=group, workers=8,
                        max_in_flight=64, poll_timeout=0.05)
    consumer.start()
    try:
        eventually(lambda: len(seen) >= total, timeout=30, message="all processed")
    finally:
        consumer.stop(5)
    assert sorted(int(m.raw_body) for m in seen) == list(range(total))
    assert {m.attempt for m in seen} == {1}
    broker.close()
    again = make(rabbitmq_url, brokers)
    assert drain(again, topic, group, within=0.5) == []  # every ack reached the server


def test_prefetch_bounds_unacked_deliveries(
    rabbitmq_url: str, names: tuple[str, str], brokers: list[Any]
) -> None:
    topic, group = names
    broker = make(rabbitmq_url, brokers, prefetch=3)
    broker.subscribe(topic, group)
    for i in range(6):
        broker.publish(topic, str(i).encode())
    first = drain(broker, topic, group, within=0.5, batch=100)
    assert len(first) == 3
    for m in first:
        broker.ack(m)
    rest = drain(broker, topic, group, count=3, within=10, batch=100)
    assert sorted(int(m.raw_body) for m in first + rest) == list(range(6))
    for m in rest:
        broker.ack(m)


def test_publishing_where_no_group_listens_raises(
    rabbitmq_url: str, names: tuple[str, str], brokers: list[Any]
) -> None:
    from msgpatterns.errors import UnroutableError

    topic, group = names
    broker = make(rabbitmq_url, brokers)
    with pytest.raises(UnroutableError):
        broker.publish(topic, b"nobody listens")
    broker.subscribe(topic, group)
    broker.publish(topic, b"now someone does")
    [m] = drain(broker, topic, group, count=1)
    broker.ack(m)
