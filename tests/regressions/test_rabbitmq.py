"""The RabbitMQ adapter: the holes found from the outside (first collected in issue 10),
each reproduced by a test on the real server (guest/guest on 127.0.0.1:5672): messages
come from foreign clients (``amqp-publish`` of Debian's amqp-tools, plain pika with
explicit properties), and ``rabbitmqctl list_queues`` shows what is left on the server."""

from __future__ import annotations

import contextlib
import datetime
import logging
import shutil
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import pytest

from broker_harness import drain, eventually, require_library
from msgpatterns import Backoff, Consumer, Message, Reject, RetryPolicy
from msgpatterns.deadletter import DeadLetter
from msgpatterns.errors import (
    BrokerClosed,
    BrokerError,
    BrokerUnavailable,
    ConfigurationError,
    UnroutableError,
)
from msgpatterns.headers import ATTEMPT

pytestmark = [
    pytest.mark.rabbitmq,
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("rabbitmqctl") is None or shutil.which("amqp-publish")
                       is None, reason="needs rabbitmqctl and amqp-publish (amqp-tools)"),
]


@pytest.fixture
def rabbitmq_url(rabbitmq_url: str) -> str:
    require_library("pika", "RabbitMQBroker")
    return rabbitmq_url


@pytest.fixture
def names(rabbitmq_url: str, unique: str) -> Iterator[tuple[str, str]]:
    """A topic and group of our own; every queue and exchange a test here can create
    under them is deleted afterwards (retry queues too: a long one would outlive the
    test by weeks). Deleting what does not exist is fine."""
    topic, group = f"rr-{unique}", f"g-{unique}"
    yield topic, group
    import pika

    main, other = f"{topic}.{group}", f"{topic}.other"
    doomed = [main, f"{main}.dlq", other, f"{other}.dlq",
              *(f"{main}.retry.{ms}" for ms in (50, 4_200_000_000))]
    conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    try:
        channel = conn.channel()
        for name in doomed:
            channel.queue_delete(name)
        for name in (topic, f"{topic}-unbound", f"{topic}-nobody"):
            channel.exchange_delete(name)
    finally:
        conn.close()


@pytest.fixture
def brokers() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for broker in made:
        with contextlib.suppress(BrokerError):
            broker.close()


def make(url: str, made: list[Any], **kwargs: Any) -> Any:
    from msgpatterns.brokers import RabbitMQBroker

    broker = RabbitMQBroker(url, **kwargs)
    made.append(broker)
    return broker


def rabbitmqctl(*args: str) -> list[list[str]]:
    out = subprocess.run(["rabbitmqctl", *args, "-q", "--no-table-headers"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return [line.split("\t") for line in out.splitlines() if line.strip()]


def queues(prefix: str) -> dict[str, tuple[int, int]]:
    """name -> (messages_ready, messages_unacknowledged) of our queues, per the server."""
    rows = rabbitmqctl("list_queues", "name", "messages_ready", "messages_unacknowledged")
    return {r[0]: (int(r[1]), int(r[2])) for r in rows if r[0].startswith(prefix)}


def exchanges(prefix: str) -> list[str]:
    return [r[0] for r in rabbitmqctl("list_exchanges", "name") if r[0].startswith(prefix)]


def settled_on_server(prefix: str, expected: dict[str, tuple[int, int]]) -> None:
    """The server's counts reach ``expected`` (its statistics may lag a moment)."""
    eventually(lambda: queues(prefix) == expected, timeout=20, every=0.2,
               message=f"queue counts {expected}")


def amqp_publish(url: str, queue: str, body: bytes, *headers: str) -> None:
    """Publish with the foreign C client, to ``queue`` through the default exchange."""
    args: list[str | bytes] = ["amqp-publish", f"--url={url}", "-r", queue, "-b", body]
    for header in headers:
        args += ["-H", header]
    subprocess.run(args, check=True, timeout=30)


def pika_publish(url: str, queue: str, *bodies: bytes, **properties: Any) -> None:
    """Publish with plain pika and explicit properties (typed headers, message_id)."""
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        channel = conn.channel()
        channel.confirm_delivery()
        for body in bodies:
            channel.basic_publish("", queue, body, pika.BasicProperties(**properties))
    finally:
        conn.close()


def run_consumer(broker: Any, topic: str, group: str, handler: Any, done: Any,
                 **kwargs: Any) -> Consumer:
    consumer = Consumer(broker, handler, topics=[topic], group=group, poll_timeout=0.05,
                        **kwargs)
    consumer.start()
    try:
        eventually(done, timeout=20, every=0.1, message="consumer finished its work")
    finally:
        consumer.stop(5)
    return consumer


# -- hole 2 -------------------------------------------------------------------------


def test_foreign_messages_without_message_id_get_no_colliding_id(
    rabbitmq_url: str, names: tuple[str, str], brokers: list[Any]
) -> None:
    """Hole 2: two consumers (two connections, both at delivery tag 1) get two different
    foreign messages without an AMQP message_id: their ids must not collide (they are
    None, never ``queue:delivery_tag``); a publisher's message_id is the id, the same
    on every redelivery and on the dead letter."""
    topic, group = names
    a = make(rabbitmq_url, brokers, prefetch=1)
    b = make(rabbitmq_url, brokers, prefetch=1)
    a.subscribe(topic, group)
    queue = a.queue_name(topic, group)
    amqp_publish(rabbitmq_url, queue, b"first")
    amqp_publish(rabbitmq_url, queue, b"second")
    [ma] = drain(a, topic, group, count=1)
    [mb] = drain(b, topic, group, count=1)
    assert {ma.raw_body, mb.raw_body} == {b"first", b"second"}
    assert ma.receipt.delivery_tag == mb.receipt.delivery_tag  # the old id's only part
    assert ma.id is None and mb.id is None
    a.ack(ma)
    b.ack(mb)
    b.close()  # one consumer from here on: redeliveries come back to ``a``

    pika_publish(rabbitmq_url, queue, b"with id", message_id="order-7")
    [first] = drain(a, topic, group, count=1)
    assert (first.id, first.attempt) == ("order-7", 1)
    a.nack(first, 0.0)
    [second] = drain(a, topic, group, count=1)
    assert (second.id, second.attempt) == ("order-7", 2)
    a.nack(second, 0.05)  # through a retry queue
    [third] = drain(a, topic, group, count=1)
    assert (third.id, third.attempt, third.raw_body) == ("order-7", 3, b"with id")
    a.dead_letter(third, DeadLetter.from_error(third, Reject("done"), now=a.now(),
                                               group=group))
    [record] = a.list_dead_letters(topic, group)
    assert (record.id, record.attempts) == ("order-7", 3)


# -- hole 4 -------------------------------------------------------------------------


def test_unroutable_publish_raises_at_once_and_disturbs_nothing_in_flight(
    rabbitmq_url: str, names: tuple[str, str], brokers: list[Any]
) -> None:
    """Hole 4: with 200 deliveries in flight, a publish nothing would keep (no such
    exchange; an exchange with no queue bound) raises UnroutableError on a connection
    that stays up: nothing is redelivered, nothing is left behind."""
    import pika

    topic, group = names
    broker = make(rabbitmq_url, brokers, prefetch=250)
    broker.subscribe(topic, group)
    queue = broker.queue_name(topic, group)
    pika_publish(rabbitmq_url, queue, *(f"m{i}".encode() for i in range(200)))
    held = drain(broker, topic, group, count=200, batch=200, within=30)
    assert len({m.raw_body for m in held}) == 200

    with pytest.raises(UnroutableError):
        broker.publish(f"{topic}-nobody", b"lost?")  # no such exchange
    conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    conn.channel().exchange_declare(f"{topic}-unbound", exchange_type="fanout")
    conn.close()
    with pytest.raises(UnroutableError):
        broker.publish(f"{topic}-unbound", b"lost?")  # an exchange, no queue bound

    assert drain(broker, topic, group, within=0.5, batch=250) == []  # no redelivery
    for m in held:
        broker.ack(m)
    broker.publish(topic, b"still works")
    [after] = drain(broker, topic, group, count=1)
    assert after.attempt == 1
    broker.ack(after)
    broker.close()
    settled_on_server(topic, {queue: (0, 0)})
    assert sorted(exchanges(topic)) == [topic, f"{topic}-unbound"]  # nothing declared


# -- hole 13 ------------------------------------------------------------------------


@pytest.mark.parametrize("queue_type", ["classic", "quorum"])
def test_hostile_header_values_dead_letter_only_their_message(
    rabbitmq_url: str, names: tuple[str, str], brokers: list[Any], queue_type: str
) -> None:
    """Hole 13: header values from the wire are data. A delivery count or attempt
    header that is not a count dead-letters that message (the reason names the header);
    values of other types (list, bytes, nested table, timestamp, decimal) reach the
    handler as text; the messages around them are handled exactly once."""
    topic, group = names
    broker = make(rabbitmq_url, brokers, queue_type=queue_type)
    broker.subscribe(topic, group)
    queue = broker.queue_name(topic, group)
    amqp_publish(rabbitmq_url, queue, b"before")
    amqp_publish(rabbitmq_url, queue, b"bad count", "x-delivery-count: abc")
    amqp_publish(rabbitmq_url, queue, b"bad attempt", f"{ATTEMPT}: abc")
    pika_publish(rabbitmq_url, queue, b"list attempt", headers={ATTEMPT: [1, 2]})
    pika_publish(rabbitmq_url, queue, b"typed", headers={
        "x-list": [1, "a"], "x-bytes": b"\xff\x00", "x-table": {"a": {"b": 1}},
        "x-when": datetime.datetime(2024, 1, 2, 3, 4, 5), "x-dec": Decimal("1.5"),
    })
    amqp_publish(rabbitmq_url, queue, b"after")
    seen: list[Message] = []
    lock = threading.Lock()

    def handler(message: Message) -> None:
        with lock:
            seen.append(message)

    run_consumer(broker, topic, group, handler,
                 lambda: len(seen) >= 3 and len(broker.list_dead_letters(topic, group)) >= 3)
    assert Counter(m.raw_body for m in seen) == {b"before": 1, b"typed": 1, b"after": 1}
    [typed] = [m for m in seen if m.raw_body == b"typed"]
    assert all(isinstance(v, str) for v in typed.headers.values())
    reasons = {r.message.raw_body: r.reason for r in broker.list_dead_letters(topic, group)}
    assert set(reasons) == {b"bad count", b"bad attempt", b"list attempt"}
    assert "x-delivery-count" in reasons[b"bad count"]
    assert ATTEMPT in reasons[b"bad attempt"] and ATTEMPT in reasons[b"list attempt"]
    broker.close()
    settled_on_server(topic, {queue: (0, 0), f"{queue}.dlq": (3, 0)})


# -- hole 14 ------------------------------------------------------------------------


def test_a_refused_nack_delay_hands_the_delivery_back_and_huge_delays_fit_the_ttl(
    rabbitmq_url: str, names: tuple[str, str], brokers: list[Any]
) -> None:
    """Hole 14: ``nack(delay=inf)`` is refused (ConfigurationError) and the delivery
    goes back to its queue instead of hanging unacked; a 31-year delay lands in a retry
    queue within RabbitMQ's TTL limit instead of breaking the channel."""
    topic, group = names
    broker = make(rabbitmq_url, brokers)
    broker.subscribe(topic, group)
    queue = broker.queue_name(topic, group)
    amqp_publish(rabbitmq_url, queue, b"payload")
    [m] = drain(broker, topic, group, count=1)
    for bad in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ConfigurationError):
            broker.nack(m, bad)
        [m] = drain(broker, topic, group, count=1)  # handed back, not stranded
        assert m.raw_body == b"payload"
    broker.nack(m, 10**9)
    assert drain(broker, topic, group, within=0.3) == []
    broker.close()
    retry = broker.retry_queue_name(queue, 4_200_000_000)
    settled_on_server(topic, {queue: (0, 0), retry: (1, 0)})


def test_texts_with_lone_surrogates_are_escaped_on_retry_and_dead_letter(
    rabbitmq_url: str, names: tuple[str, str], brokers: list[Any]
) -> None:
    """Hole 14: a non-UTF-8 body decoded with ``surrogateescape`` ends up in an error
    message, a header and a Reject reason: the retry and the dead letter are still
    written (texts escaped), nothing stays unacked, the DLQ holds the record."""
    topic, group = names
    broker = make(rabbitmq_url, brokers)
    broker.subscribe(topic, group)
    queue = broker.queue_name(topic, group)
    amqp_publish(rabbitmq_url, queue, b"caf\xe9 \xff")
    attempts: list[int] = []

    def handler(message: Message) -> None:
        attempts.append(message.attempt)
        text = message.raw_body.decode("utf-8", "surrogateescape")
        message.headers["x-text"] = text
        if message.attempt == 1:
            raise ValueError(f"cannot parse {text}")
        raise Reject(f"still cannot parse {text}")

    retry = RetryPolicy(max_attempts=5, backoff=Backoff.levels([0.05]), local_retries=0)
    run_consumer(broker, topic, group, handler,
                 lambda: len(broker.list_dead_letters(topic, group)) == 1, retry=retry)
    assert attempts == [1, 2]
    [record] = broker.list_dead_letters(topic, group)
    assert record.message.raw_body == b"caf\xe9 \xff"
    assert "\\udce9" in record.reason and "\\udce9" in record.message.headers["x-text"]
    broker.close()
    retry_queue = broker.retry_queue_name(queue, 50)  # empty, expires a minute later
    settled_on_server(topic, {queue: (0, 0), f"{queue}.dlq": (1, 0), retry_queue: (0, 0)})


# -- hole 9 -------------------------------------------------------------------------


def test_a_wrong_password_fails_at_once_with_one_clear_line(
    rabbitmq_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Hole 9: authentication errors are never retried as transient: one
    BrokerUnavailable naming the server and the user (never the password)."""
    import inspect

    import pika

    from msgpatterns.brokers import RabbitMQBroker

    params = pika.URLParameters(rabbitmq_url)
    url = f"amqp://{params.credentials.username}:not-the-password@{params.host}:{params.port}/"
    caplog.set_level(logging.WARNING, logger="msgpatterns")
    with pytest.raises(BrokerUnavailable) as info:
        RabbitMQBroker(url)
    text = str(info.value)
    assert "\n" not in text and "not-the-password" not in text
    assert repr(params.credentials.username) in text and "password" in text
    assert isinstance(info.value.__cause__, pika.exceptions.AMQPConnectionError)
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]  # no retry
    assert inspect.signature(RabbitMQBroker).parameters["connect_timeout"].default <= 5


# -- holes 1 and 5 ------------------------------------------------------------------


def test_close_flushes_acks_and_afterwards_everything_raises_broker_closed(
    rabbitmq_url: str, names: tuple[str, str], brokers: list[Any]
) -> None:
    """Holes 1/5: ``close()`` sends the acks queued just before it; afterwards every
    operation raises BrokerClosed at once (publish is not retried), and the closed
    broker never connects again."""
    from msgpatterns.brokers import RabbitMQBroker

    topic, group = names
    with RabbitMQBroker(rabbitmq_url) as broker:
        broker.subscribe(topic, group)
        queue = broker.queue_name(topic, group)
        for i in range(20):
            broker.publish(topic, f"m{i}".encode())
        got = drain(broker, topic, group, count=20, batch=20)
        kept = got.pop()
        for m in got:
            broker.ack(m)  # queued: not waited for
    settled_on_server(topic, {queue: (1, 0)})  # only the unacked one went back
    record = DeadLetter.from_error(kept, Reject("x"), now=0.0, group=group)
    calls = [
        lambda: broker.publish(topic, b"late"),
        lambda: broker.fetch([topic], group, 1, 0.1),
        lambda: broker.subscribe(topic, group),
        lambda: broker.ack(kept),
        lambda: broker.nack(kept, 0.0),
        lambda: broker.dead_letter(kept, record),
        lambda: broker.list_dead_letters(topic, group),
    ]
    for call in calls:
        with pytest.raises(BrokerClosed):
            call()
    names_on_server = [r[0] for r in rabbitmqctl("list_connections", "client_properties")]
    assert not any(broker.name in props for props in names_on_server)
    broker.close()  # idempotent


def test_a_refused_declaration_raises_a_broker_error_and_keeps_deliveries(
    rabbitmq_url: str, names: tuple[str, str], brokers: list[Any]
) -> None:
    """Hole 5: no pika exception escapes bare; a refusal by the server (a queue of
    another type under the group's name) closes only the side channel: the deliveries
    in flight are not redelivered."""
    import pika

    topic, group = names
    broker = make(rabbitmq_url, brokers)
    broker.subscribe(topic, group)
    broker.publish(topic, b"held")
    [held] = drain(broker, topic, group, count=1)
    other = f"{topic}.other"
    conn = pika.BlockingConnection(pika.URLParameters(rabbitmq_url))
    conn.channel().queue_declare(broker.queue_name(topic, "other"), durable=True)  # classic
    conn.close()
    with pytest.raises(BrokerError) as info:
        broker.subscribe(topic, "other")  # quorum wanted: PRECONDITION_FAILED
    assert not isinstance(info.value, pika.exceptions.AMQPError)
    assert isinstance(info.value.__cause__, pika.exceptions.AMQPError)
    assert drain(broker, topic, group, within=0.3) == []  # nothing redelivered
    broker.ack(held)
    broker.close()
    settled_on_server(topic, {broker.queue_name(topic, group): (0, 0), other: (0, 0)})
