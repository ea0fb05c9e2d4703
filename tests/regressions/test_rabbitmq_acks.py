"""The RabbitMQ adapter, batched acks (issue 15): settled deliveries go out as one
``basic_ack(multiple=True)`` per flush, and only the contiguous settled prefix of the
channel's delivery tags may go that way. Checked on the real server (``rabbitmqctl
list_queues``: ready / unacknowledged counts) with out-of-order settlement, held-back
deliveries, a nack and a hand-back in between, close() racing acks, and messages from a
foreign publisher (``amqp-publish``)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from test_rabbitmq import (  # the shared fixtures and server probes of these tests
    amqp_publish,
    brokers,
    make,
    names,
    rabbitmq_url,
    settled_on_server,
)

from broker_harness import drain, kill_rabbitmq_connection
from msgpatterns import Consumer, Message
from msgpatterns.errors import BrokerClosed, ConfigurationError

__all__ = ["brokers", "names", "rabbitmq_url"]  # fixtures, re-exported for pytest

pytestmark = [pytest.mark.rabbitmq, pytest.mark.timeout(60)]


def delivered(url: str, made: list[Any], names: tuple[str, str], n: int,
              **options: Any) -> tuple[Any, str, list[Message]]:
    """A broker of ``names``' group, ``n`` messages published to the topic and fetched
    (in delivery-tag order): (broker, its queue, the deliveries)."""
    topic, group = names
    broker = make(url, made, **options)
    broker.subscribe(topic, group)
    for i in range(n):
        broker.publish(topic, f"m{i}".encode())
    got = drain(broker, topic, group, count=n, batch=n)
    assert [m.raw_body for m in got] == [f"m{i}".encode() for i in range(n)]
    return broker, broker.queue_name(topic, group), got


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_out_of_order_settlement_never_acks_past_a_held_delivery(
    rabbitmq_url: str, names: tuple[str, str], brokers: list[Any], queue_type: str
) -> None:
    """Eight deliveries, settled in reverse order with the 3rd and 6th held back: the
    server shows exactly those two unacknowledged (nothing after a held tag was acked
    early, nothing settled was left unacked); when the consumer dies they, and only
    they, come back."""
    topic, group = names
    broker, queue, got = delivered(rabbitmq_url, brokers, names, 8, prefetch=20,
                                   queue_type=queue_type)
    held = [got[2], got[5]]
    for m in reversed(got):
        if m not in held:
            broker.ack(m)
    settled_on_server(topic, {queue: (0, 2)})
    kill_rabbitmq_connection(broker)  # dies holding the two
    settled_on_server(topic, {queue: (2, 0)})
    again = make(rabbitmq_url, brokers, queue_type=queue_type)
    back = drain(again, topic, group, count=2)
    assert sorted(m.raw_body for m in back) == [b"m2", b"m5"]
    assert drain(again, topic, group, within=0.5) == []
    for m in back:
        again.ack(m)
    again.close()
    settled_on_server(topic, {queue: (0, 0)})


def test_a_nack_and_a_hand_back_between_acks_stay_exact(
    rabbitmq_url: str, names: tuple[str, str], brokers: list[Any]
) -> None:
    """Between acks: a nack (a retry copy published, then the original acked) and a
    hand-back (``basic_nack`` with requeue, after a refused delay). The prefix passes
    both; the retry and the handed-back delivery come back once each; the one held
    delivery stays unacknowledged until close() returns it."""
    topic, group = names
    broker, queue, got = delivered(rabbitmq_url, brokers, names, 6, prefetch=20)
    broker.ack(got[0])
    broker.nack(got[1], 0.0)
    broker.ack(got[2])
    with pytest.raises(ConfigurationError):
        broker.nack(got[3], -1.0)  # refused: handed back to the queue first
    broker.ack(got[4])
    back = drain(broker, topic, group, count=2, batch=2)
    by_body = {m.raw_body: m for m in back}
    assert set(by_body) == {b"m1", b"m3"}
    assert by_body[b"m1"].attempt == 2 and by_body[b"m1"].id == got[1].id
    for m in back:
        broker.ack(m)
    settled_on_server(topic, {queue: (0, 1)})  # only m5, held
    assert drain(broker, topic, group, within=0.5) == []
    broker.close()
    settled_on_server(topic, {queue: (1, 0)})


def test_close_racing_acks_sends_every_ack_that_was_accepted(
    rabbitmq_url: str, names: tuple[str, str], brokers: list[Any]
) -> None:
    """Four threads ack 40 deliveries while close() runs: every ack that returned is
    on the server after close (batched or not), every one that raised BrokerClosed is
    not; the counts add up exactly."""
    topic, group = names
    broker, queue, got = delivered(rabbitmq_url, brokers, names, 40, prefetch=50)
    accepted: list[Message] = []
    refused: list[Message] = []
    lock = threading.Lock()
    start = threading.Barrier(5)

    def ack_all(share: list[Message]) -> None:
        start.wait()
        for m in share:
            try:
                broker.ack(m)
            except BrokerClosed:
                with lock:
                    refused.append(m)
            else:
                with lock:
                    accepted.append(m)

    threads = [threading.Thread(target=ack_all, args=(got[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    start.wait()
    broker.close()
    for t in threads:
        t.join(10)
    assert len(accepted) + len(refused) == 40
    settled_on_server(topic, {queue: (len(refused), 0)})
    again = make(rabbitmq_url, brokers)
    back = drain(again, topic, group, count=len(refused), within=10 if refused else 0.5)
    assert sorted(m.raw_body for m in back) == sorted(m.raw_body for m in refused)
    for m in back:
        again.ack(m)


def test_foreign_publisher_messages_are_acked_in_batches_and_never_redelivered(
    rabbitmq_url: str, names: tuple[str, str], brokers: list[Any]
) -> None:
    """amqp-publish (the C client) writes 30 messages straight to the group's queue;
    a Consumer with four workers handles each once, and after stop/close the server
    holds nothing, ready or unacknowledged."""
    topic, group = names
    broker = make(rabbitmq_url, brokers, prefetch=16)
    broker.subscribe(topic, group)
    queue = broker.queue_name(topic, group)
    for i in range(30):
        amqp_publish(rabbitmq_url, queue, f"f{i}".encode(), "origin:amqp-tools")
    handled: list[bytes] = []
    lock = threading.Lock()
    done = threading.Event()

    def handler(message: Message) -> None:
        assert message.headers["origin"] == "amqp-tools"
        with lock:
            handled.append(message.raw_body)
            if len(handled) == 30:
                done.set()

    consumer = Consumer(broker, handler, topics=[topic], group=group, poll_timeout=0.05,
                        max_in_flight=16, workers=4)
    consumer.start()
    try:
        assert done.wait(30)
    finally:
        consumer.stop(5)
    broker.close()
    assert sorted(handled) == sorted(f"f{i}".encode() for i in range(30))
    settled_on_server(topic, {queue: (0, 0)})
