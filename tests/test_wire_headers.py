"""The library's own headers are producer data: a forged or corrupt one dead-letters
that one message with a reason naming the header, and nothing else is affected.

Each adapter is fed by a foreign publisher (plain nats-py, pika / ``amqp-publish``,
confluent-kafka's Producer) with messages carrying ``x-msgpatterns-retry-due-at: inf``,
a due time ten years out, ``x-msgpatterns-attempt: 1000000`` and the like, mixed with
good messages that must still be delivered in the same fetch.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from broker_harness import (
    KAFKA_TEST_CONSUMER,
    delete_nats_stream,
    delete_rabbitmq_topology,
    drain,
    kafka_cluster,
    require_library,
)
from msgpatterns import headers as h
from msgpatterns.testing import services

pytestmark = [pytest.mark.timeout(90)]

TEN_YEARS = 10 * 365 * 86_400.0

#: (label, headers) of messages whose library headers are unusable.
HOSTILE = [
    ("due-inf", {h.RETRY_DUE_AT: "inf"}),
    ("due-nan", {h.RETRY_DUE_AT: "nan"}),
    ("due-10y", {h.RETRY_DUE_AT: repr(time.time() + TEN_YEARS)}),
    ("attempt-huge", {h.ATTEMPT: "1000000"}),
    ("attempt-zero", {h.ATTEMPT: "0"}),
    ("first-failed-inf", {h.FIRST_FAILED_AT: "-inf"}),
]


# -- the shared check ------------------------------------------------------------------


@pytest.mark.parametrize(("label", "headers"), HOSTILE)
def test_header_problem_names_the_header(label: str, headers: dict[str, str]) -> None:
    problem = h.header_problem(headers, now=time.time())
    assert problem is not None and next(iter(headers)) in problem, (label, problem)


@pytest.mark.parametrize("headers", [
    {},
    {"plain": "inf", "x-other": "1000000"},
    {h.ATTEMPT: "3", h.RETRY_DUE_AT: repr(time.time() + 60)},
    {h.ATTEMPT: str(h.MAX_ATTEMPT), h.FIRST_FAILED_AT: "1700000000.5"},
])
def test_header_problem_accepts_what_the_library_writes(headers: dict[str, str]) -> None:
    assert h.header_problem(headers, now=time.time()) is None


def test_a_due_time_is_bounded_only_when_now_is_given() -> None:
    far = {h.RETRY_DUE_AT: repr(time.time() + TEN_YEARS)}
    assert h.header_problem(far) is None
    assert h.header_problem(far, now=time.time()) is not None
    assert h.header_problem(far, now=time.time(), max_delay=2 * TEN_YEARS) is None
    assert h.header_problem({h.ATTEMPT: "20"}, max_attempt=16) is not None


def test_a_long_value_is_quoted_short() -> None:
    problem = h.header_problem({h.ATTEMPT: "9" * 10_000})
    assert problem is not None and len(problem) < 200


# -- NATS JetStream ----------------------------------------------------------------------


@pytest.fixture
def nats_url() -> str:
    require_library("nats", "NatsJetStreamBroker")
    return services.require("nats")


@pytest.fixture
def nats_topic(nats_url: str, unique: str) -> Iterator[str]:
    name = f"hdr-{unique}"
    yield name
    delete_nats_stream(nats_url, name)


def nats_publish(url: str, subject: str, items: list[tuple[bytes, dict[str, str]]]) -> None:
    """Publish with plain nats-py, as another team's service would."""
    import nats

    async def publish() -> None:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            for body, headers in items:
                await js.publish(subject, body, headers=headers or None)
        finally:
            await nc.close()

    asyncio.run(publish())


def _hostile_then_good() -> list[tuple[bytes, dict[str, str]]]:
    items: list[tuple[bytes, dict[str, str]]] = []
    for i, (label, headers) in enumerate(HOSTILE):
        items.append((label.encode(), {**headers, "plain": "kept"}))
        items.append((f"good-{i}".encode(), {}))
    return items


def _assert_dead_lettered_with_reasons(dead: list, labels: list[str]) -> None:
    reasons = {d.message.raw_body.decode(): d.reason for d in dead}
    assert sorted(reasons) == sorted(labels), reasons
    for label, headers in HOSTILE:
        if label in reasons:
            assert next(iter(headers)) in reasons[label], (label, reasons[label])
            assert "out of range" in reasons[label] or "not" in reasons[label]


@pytest.mark.nats
def test_nats_forged_headers_dead_letter_that_message_and_nothing_else(
        nats_url: str, nats_topic: str) -> None:
    """Before: ``retry-due-at: inf`` made ``nak(delay=inf)`` raise OverflowError and the
    whole fetch failed; a due time 10 years out parked the message for 10 years."""
    from msgpatterns.brokers import NatsJetStreamBroker

    with NatsJetStreamBroker(nats_url) as broker:
        broker.subscribe(nats_topic, "g")
        nats_publish(nats_url, nats_topic, _hostile_then_good())
        got = drain(broker, nats_topic, "g", count=len(HOSTILE), within=15)
        assert sorted(m.raw_body for m in got) == sorted(
            f"good-{i}".encode() for i in range(len(HOSTILE)))
        for message in got:
            assert message.attempt == 1
            broker.ack(message)
        dead = broker.list_dead_letters(nats_topic, "g")
    _assert_dead_lettered_with_reasons(dead, [label for label, _ in HOSTILE])
    assert all(d.message.headers.get("plain") == "kept" for d in dead)
    assert all(d.group == "g" for d in dead)


@pytest.mark.nats
@pytest.mark.parametrize("face", ["threaded", "native"])
def test_nats_forged_headers_on_the_async_face(nats_url: str, nats_topic: str,
                                               face: str) -> None:
    from msgpatterns.aio import AsyncNatsJetStreamBroker, ThreadedAsyncBroker
    from msgpatterns.brokers import NatsJetStreamBroker

    def dead_letters() -> list:
        with NatsJetStreamBroker(nats_url) as admin:
            return admin.list_dead_letters(nats_topic, "g")

    async def run() -> list:
        broker: Any = (ThreadedAsyncBroker(NatsJetStreamBroker(nats_url)) if face == "threaded"
                       else AsyncNatsJetStreamBroker(nats_url))
        try:
            await broker.subscribe(nats_topic, "g")
            await asyncio.to_thread(nats_publish, nats_url, nats_topic, [
                (b"due-inf", {h.RETRY_DUE_AT: "inf"}), (b"good", {})])
            got: list = []
            give_up = time.monotonic() + 15
            while not got and time.monotonic() < give_up:
                got = await broker.fetch([nats_topic], "g", max_messages=10, timeout=0.5)
            assert [m.raw_body for m in got] == [b"good"]
            await broker.ack(got[0])
            return await asyncio.to_thread(dead_letters)
        finally:
            await broker.close()

    dead = asyncio.run(run())
    assert [d.message.raw_body for d in dead] == [b"due-inf"]
    assert h.RETRY_DUE_AT in dead[0].reason


# -- RabbitMQ ------------------------------------------------------------------------------


@pytest.fixture
def rabbit_names(rabbitmq_url: str, unique: str) -> Iterator[tuple[str, str]]:
    require_library("pika", "RabbitMQBroker")
    topic, group = f"hdr-{unique}", f"g-{unique}"
    yield topic, group
    delete_rabbitmq_topology(rabbitmq_url, topic, group)


def amqp_publish(url: str, exchange: str, routing_key: str, body: bytes,
                 headers: dict[str, str]) -> None:
    """``amqp-publish`` (librabbitmq's tool) when installed, else plain pika."""
    tool = shutil.which("amqp-publish")
    if tool is not None:
        args = [tool, "--url", url, "-e", exchange, "-r", routing_key, "-b",
                body.decode()]
        for name, value in headers.items():
            args += ["-H", f"{name}: {value}"]
        subprocess.run(args, check=True, timeout=30, capture_output=True)
        return
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        conn.channel().basic_publish(exchange, routing_key, body,
                                     pika.BasicProperties(headers=headers))
    finally:
        conn.close()


RABBIT_HOSTILE = [(label, headers) for label, headers in HOSTILE
                  if h.RETRY_DUE_AT not in headers]


@pytest.mark.rabbitmq
def test_rabbitmq_forged_headers_dead_letter_that_message(
        rabbitmq_url: str, rabbit_names: tuple[str, str]) -> None:
    """Before: ``attempt: 1000000`` was taken at its word (dead-lettered after one
    transient failure, with a reason that blamed the handler)."""
    from msgpatterns.brokers import RabbitMQBroker

    topic, group = rabbit_names
    with RabbitMQBroker(rabbitmq_url) as broker:
        broker.subscribe(topic, group)
        for label, headers in RABBIT_HOSTILE:
            amqp_publish(rabbitmq_url, topic, topic, label.encode(), headers)
        amqp_publish(rabbitmq_url, topic, topic, b"good", {h.ATTEMPT: "2"})
        got = drain(broker, topic, group, count=1, within=15)
        assert [(m.raw_body, m.attempt) for m in got] == [(b"good", 2)]
        broker.ack(got[0])
        dead = _eventually_dead(broker, topic, group, len(RABBIT_HOSTILE))
    _assert_dead_lettered_with_reasons(dead, [label for label, _ in RABBIT_HOSTILE])


@pytest.mark.rabbitmq
def test_rabbitmq_async_forged_attempt_dead_letters_that_message(
        rabbitmq_url: str, rabbit_names: tuple[str, str]) -> None:
    require_library("aio_pika", "AsyncRabbitMQBroker")
    from msgpatterns.aio.rabbitmq import AsyncRabbitMQBroker
    from msgpatterns.brokers import RabbitMQBroker

    topic, group = rabbit_names

    async def run() -> None:
        async with AsyncRabbitMQBroker(rabbitmq_url) as broker:
            await broker.subscribe(topic, group)
            await asyncio.to_thread(amqp_publish, rabbitmq_url, topic, topic,
                                    b"attempt-huge", {h.ATTEMPT: "1000000"})
            await asyncio.to_thread(amqp_publish, rabbitmq_url, topic, topic, b"good", {})
            got: list = []
            give_up = time.monotonic() + 15
            while not got and time.monotonic() < give_up:
                got = await broker.fetch([topic], group, max_messages=10, timeout=0.5)
            assert [m.raw_body for m in got] == [b"good"]
            await broker.ack(got[0])

    asyncio.run(run())
    with RabbitMQBroker(rabbitmq_url) as admin:
        dead = _eventually_dead(admin, topic, group, 1)
    assert dead[0].message.raw_body == b"attempt-huge"
    assert h.ATTEMPT in dead[0].reason and "out of range" in dead[0].reason


def _eventually_dead(broker: Any, topic: str, group: str, count: int) -> list[Any]:
    give_up = time.monotonic() + 15
    while True:
        dead = broker.list_dead_letters(topic, group)
        if len(dead) >= count or time.monotonic() > give_up:
            return dead
        time.sleep(0.05)


# -- Kafka (librdkafka mock cluster) --------------------------------------------------------


def kafka_produce(bootstrap: str, topic: str,
                  items: list[tuple[bytes, dict[str, str]]]) -> None:
    """Write records with confluent-kafka's plain Producer, partition 0."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap})
    for body, headers in items:
        producer.produce(topic, body, partition=0, headers=list(headers.items()))
    assert producer.flush(30) == 0


@pytest.fixture
def kafka_bootstrap() -> str:
    return str(kafka_cluster().bootstrap_servers)


@pytest.mark.kafka
def test_kafka_forged_headers_dead_letter_that_record(kafka_bootstrap: str) -> None:
    """Before: a retry record due in 10 years paused its partition for 10 years, and
    ``attempt: 1000000`` was taken at its word."""
    from msgpatterns.brokers import KafkaBroker

    topic, group = f"hdr-{uuid.uuid4().hex[:10]}", f"g-{uuid.uuid4().hex[:6]}"
    with KafkaBroker(kafka_bootstrap, consumer_config=KAFKA_TEST_CONSUMER) as broker:
        retry_topic = broker.retry_topic(topic)
        kafka_produce(kafka_bootstrap, topic, [
            (b"attempt-huge", {h.ATTEMPT: "1000000"}), (b"good", {})])
        kafka_produce(kafka_bootstrap, retry_topic, [
            (b"due-10y", {h.RETRY_DUE_AT: repr(time.time() + TEN_YEARS),
                          "x-msgpatterns-group": group}),
            (b"due-inf", {h.RETRY_DUE_AT: "inf", "x-msgpatterns-group": group}),
            (b"retry-good", {h.ATTEMPT: "2", "x-msgpatterns-group": group})])
        got = drain(broker, topic, group, count=2, within=30)
        assert sorted(m.raw_body for m in got) == [b"good", b"retry-good"]
        for message in got:
            broker.ack(message)
        dead = _eventually_dead(broker, topic, group, 3)
    _assert_dead_lettered_with_reasons(dead, ["attempt-huge", "due-10y", "due-inf"])


@pytest.mark.kafka
def test_kafka_async_forged_attempt_dead_letters_that_record(kafka_bootstrap: str) -> None:
    require_library("aiokafka", "AIOKafkaBroker")
    from msgpatterns.aio.kafka_native import AIOKafkaBroker
    from msgpatterns.brokers import KafkaBroker

    topic, group = f"hdr-{uuid.uuid4().hex[:10]}", f"g-{uuid.uuid4().hex[:6]}"
    kafka_produce(kafka_bootstrap, topic, [
        (b"attempt-huge", {h.ATTEMPT: "1000000"}), (b"good", {})])

    async def run() -> None:
        broker = AIOKafkaBroker(kafka_bootstrap, consumer_config={
            "fetch_max_wait_ms": 50, "session_timeout_ms": 4000,
            "heartbeat_interval_ms": 1000})
        try:
            got: list = []
            give_up = time.monotonic() + 30
            while not got and time.monotonic() < give_up:
                got = await broker.fetch([topic], group, max_messages=10, timeout=0.2)
            assert [m.raw_body for m in got] == [b"good"]
            await broker.ack(got[0])
        finally:
            await broker.close()

    asyncio.run(run())
    with KafkaBroker(kafka_bootstrap, consumer_config=KAFKA_TEST_CONSUMER) as admin:
        dead = _eventually_dead(admin, topic, group, 1)
    assert [d.message.raw_body for d in dead] == [b"attempt-huge"]
    assert h.ATTEMPT in dead[0].reason and "out of range" in dead[0].reason


# -- Redis Streams ---------------------------------------------------------------------------


@pytest.mark.redis
def test_redis_forged_attempt_dead_letters_that_entry(redis_url: str, unique: str) -> None:
    """Redis Streams already refused non-numbers; the shared check adds the range (an
    attempt of 1,000,000 was taken at its word)."""
    require_library("redis", "RedisStreamsBroker")
    from msgpatterns.brokers import RedisStreamsBroker

    topic = f"hdr-{unique}"
    cli = shutil.which("redis-cli")
    if cli is None:
        pytest.skip("redis-cli not installed")

    def redis(*args: str) -> None:
        subprocess.run([cli, "-u", redis_url, *args], check=True, timeout=30,
                       capture_output=True)

    try:
        with RedisStreamsBroker(redis_url) as broker:
            broker.subscribe(topic, "g")
            redis("XADD", topic, "*", "body", "attempt-huge",
                  "headers", f'{{"{h.ATTEMPT}": "1000000"}}')
            redis("XADD", topic, "*", "body", "good", "headers", f'{{"{h.ATTEMPT}": "2"}}')
            got = drain(broker, topic, "g", count=1, within=15)
            assert [(m.raw_body, m.attempt) for m in got] == [(b"good", 2)]
            broker.ack(got[0])
            dead = _eventually_dead(broker, topic, "g", 1)
        assert len(dead) == 1 and b"attempt-huge" in dead[0].message.raw_body
        assert h.ATTEMPT in dead[0].reason and "out of range" in dead[0].reason
    finally:
        redis("DEL", topic, f"{topic}:dlq", f"{topic}:retry:g")
