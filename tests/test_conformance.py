"""One conformance suite for every broker: the in-memory fake, Redis Streams, RabbitMQ
and Kafka (librdkafka's mock cluster), each through its real client and server.

The rules (DESIGN 2, 3, 7): publish/fetch/ack; a nack delay is honoured and the retry
carries the original payload and the headers at nack time; the attempt count survives
redelivery and restarts; the last allowed failure becomes a dead letter with the full
record; an undecodable body is dead-lettered and the consumer keeps going; a dead
consumer's deliveries reach another consumer of the group; ``max_in_flight`` holds.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from broker_harness import Harness, drain, eventually, harness_params, make_harness
from msgpatterns import Backoff, Consumer, Message, RetryPolicy
from msgpatterns.headers import FIRST_FAILED_AT

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=harness_params())
def h(request: pytest.FixtureRequest) -> Iterator[Harness]:
    yield from make_harness(request.param)


def test_publish_fetch_ack(h: Harness) -> None:
    broker = h.broker()
    ids = [broker.publish(h.topic, f"m{i}".encode(), key=f"k{i}", headers={"n": str(i)})
           for i in range(3)]
    got = drain(broker, h.topic, h.group, count=3)
    assert sorted(m.raw_body for m in got) == [b"m0", b"m1", b"m2"]
    for m in got:
        i = int(m.raw_body[1:])
        assert (m.topic, m.key, m.headers.get("n"), m.attempt) == (h.topic, f"k{i}", str(i), 1)
        assert m.id == ids[i]
        broker.ack(m)
    h.close(broker)
    again = h.broker()
    assert drain(again, h.topic, h.group, within=h.quiet) == []


def test_nack_delay_is_honoured_with_original_payload_and_current_headers(h: Harness) -> None:
    broker = h.broker()
    broker.publish(h.topic, b'{"n": 1}', key="k")
    [first] = drain(broker, h.topic, h.group, count=1)
    first.body = {"decoded": "by a decoder"}  # the retry must carry raw_body
    first.headers[FIRST_FAILED_AT] = "123.0"
    first.headers["x-note"] = "failed once"
    nacked_at = time.monotonic()
    broker.nack(first, 0.6)
    [retry] = drain(broker, h.topic, h.group, count=1, within=15)
    waited = time.monotonic() - nacked_at
    assert waited >= 0.6 - 0.02  # never early (small allowance for clock granularity)
    assert retry.raw_body == b'{"n": 1}'
    assert retry.attempt == 2
    assert retry.id == first.id and retry.key == "k" and retry.topic == h.topic
    assert retry.headers["x-note"] == "failed once"
    assert retry.headers[FIRST_FAILED_AT] == "123.0"
    broker.ack(retry)


def test_attempt_count_survives_redelivery_restart_and_crash(h: Harness) -> None:
    b1 = h.broker()
    b1.publish(h.topic, b"payload")
    [m1] = drain(b1, h.topic, h.group, count=1)
    assert m1.attempt == 1
    # A delay keeps the copy off the wire while b1 closes: a push broker's delivery in
    # transit during close is returned by the server, and a quorum queue counts that
    # as a delivery (docs/brokers.md) - not what this test is about.
    b1.nack(m1, 0.5)
    h.close(b1)

    b2 = h.broker()  # a restarted consumer
    [m2] = drain(b2, h.topic, h.group, count=1)
    assert m2.attempt == 2
    b2.nack(m2, 0.2)
    h.close(b2)

    b3 = h.broker()
    [m3] = drain(b3, h.topic, h.group, count=1)
    assert m3.attempt == 3
    h.crash(b3)  # dies holding the delivery

    b4 = h.broker()
    [m4] = drain(b4, h.topic, h.group, count=1, within=h.crash_window + 5)
    assert m4.raw_body == b"payload"
    assert m4.attempt == (4 if h.counts_crash_redeliveries else 3)
    b4.ack(m4)


def test_killed_consumer_in_flight_messages_reach_another_consumer(h: Harness) -> None:
    b1 = h.broker()
    for i in range(5):
        b1.publish(h.topic, f"m{i}".encode())
    held = drain(b1, h.topic, h.group, count=5)
    assert len(held) == 5
    h.crash(b1)
    b2 = h.broker()
    got = drain(b2, h.topic, h.group, count=5, within=h.crash_window + 5)
    assert sorted(m.raw_body for m in got) == sorted(m.raw_body for m in held)
    for m in got:
        b2.ack(m)


def _run(consumer: Consumer, until: Any, timeout: float = 20.0) -> None:
    consumer.start()
    try:
        eventually(until, timeout=timeout, message="consumer outcome")
    finally:
        consumer.stop(5)


def test_max_attempts_dead_letters_the_full_record(h: Harness) -> None:
    broker = h.broker()
    done: list[bytes] = []

    def handler(message: Message) -> None:
        if message.raw_body == b"poison":
            raise ValueError(f"boom on attempt {message.attempt}")
        done.append(message.raw_body)

    broker.publish(h.topic, b"poison", key="bad", headers={"origin": "test"})
    broker.publish(h.topic, b"fine")
    consumer = Consumer(
        broker, handler, topics=[h.topic], group=h.group, poll_timeout=0.05,
        retry=RetryPolicy(max_attempts=3, backoff=Backoff.fixed(0.05), local_retries=0),
    )
    _run(consumer, lambda: h.dead_letters(broker) and done)
    [record] = h.dead_letters(broker)
    assert record.attempts == 3
    assert record.error_type.endswith("ValueError")
    assert record.error_message == "boom on attempt 3"
    assert "ValueError: boom on attempt 3" in record.traceback
    assert record.reason.startswith("gave up after 3 attempts")
    assert record.first_failed_at <= record.last_failed_at
    assert record.last_failed_at - record.first_failed_at < 60
    assert record.message.raw_body == b"poison"
    assert record.message.key == "bad" and record.message.topic == h.topic
    assert record.message.headers["origin"] == "test"
    assert record.group == h.group
    assert done == [b"fine"]


def test_undecodable_body_is_dead_lettered_and_the_consumer_keeps_going(h: Harness) -> None:
    broker = h.broker()
    decoded: list[Any] = []
    broker.publish(h.topic, b"{not json")
    broker.publish(h.topic, b'{"ok": 1}')
    consumer = Consumer(broker, lambda m: decoded.append(m.body), topics=[h.topic],
                        group=h.group, decoder=json.loads, poll_timeout=0.05)
    consumer.start()
    try:
        eventually(lambda: h.dead_letters(broker) and decoded, message="dead letter")
        broker.publish(h.topic, b'{"ok": 2}')  # still consuming after the bad one
        eventually(lambda: len(decoded) == 2, message="next message")
    finally:
        consumer.stop(5)
    [record] = h.dead_letters(broker)
    assert record.message.raw_body == b"{not json"
    assert "cannot decode body" in record.reason
    assert record.error_type.endswith("MalformedMessage")
    assert record.attempts == 1
    assert sorted(d["ok"] for d in decoded) == [1, 2]


def test_max_in_flight_is_respected(h: Harness) -> None:
    broker = h.broker()
    total, limit = 20, 3
    for i in range(total):
        broker.publish(h.topic, str(i).encode())
    lock = threading.Lock()
    held: set[bytes] = set()
    peak = 0
    finished: list[bytes] = []

    def settle_later(message: Message) -> None:
        with lock:
            held.discard(message.raw_body)
            finished.append(message.raw_body)
        message.ack()

    def handler(message: Message) -> None:
        nonlocal peak
        message.disable_auto_ack()
        with lock:
            held.add(message.raw_body)
            peak = max(peak, len(held))
        threading.Timer(0.01, settle_later, args=(message,)).start()

    consumer = Consumer(broker, handler, topics=[h.topic], group=h.group, workers=8,
                        max_in_flight=limit, fetch_batch=10, poll_timeout=0.05)
    _run(consumer, lambda: len(set(finished)) == total)
    assert 1 <= peak <= limit
