"""A URL's password never reaches a repr, an error, a log line or a dead-letter record,
on any adapter (Redis Streams, RabbitMQ, Kafka, NATS JetStream; sync and asyncio).

Each test gives the adapter a URL with a recognisable password (``SECRET``) and then
looks everywhere it could surface: ``repr()`` of the adapter, the text, ``repr()`` and
cause chain of the error it raises on a dead or refusing server, every log record
emitted meanwhile, and - for NATS, where an error of the adapter became a dead letter -
the record's error message, reason and traceback as stored on the broker.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import traceback
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from broker_harness import delete_nats_stream, require_library
from msgpatterns import Consumer, RetryPolicy
from msgpatterns.errors import BrokerError, ConfigurationError
from msgpatterns.testing import services

pytestmark = [pytest.mark.timeout(60)]

SECRET = "pw-" + uuid.uuid4().hex[:12]


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def everything_about(error: BaseException) -> str:
    """The error's text, repr, formatted traceback and its causes'."""
    parts = []
    seen: BaseException | None = error
    while seen is not None:
        parts += [str(seen), repr(seen)]
        seen = seen.__cause__ or seen.__context__
    parts.append("".join(traceback.format_exception(error)))
    return "\n".join(parts)


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.DEBUG)
    yield caplog
    for record in caplog.records:
        assert SECRET not in record.getMessage(), record.getMessage()


def _subscribe_once(kind: Any, url: str, **options: Any) -> None:
    """Open a ``kind`` adapter on ``url``, check its repr, read once, close."""
    broker = kind(url, **options)
    try:
        assert SECRET not in repr(broker)
        broker.fetch(f"redact-{uuid.uuid4().hex[:8]}", "g", timeout=0.1)
    finally:
        broker.close()


# -- NATS JetStream ------------------------------------------------------------------


def test_nats_repr_and_connect_error_hide_the_password(logs: Any) -> None:
    require_library("nats", "NatsJetStreamBroker")
    from msgpatterns.brokers import NatsJetStreamBroker

    with pytest.raises(BrokerError) as caught:
        NatsJetStreamBroker([f"nats://alice:{SECRET}@127.0.0.1:{dead_port()}",
                             f"tls://{SECRET}@127.0.0.1:{dead_port()}"],
                            connect_timeout=1.0)
    assert SECRET not in everything_about(caught.value)


@pytest.mark.nats
def test_nats_password_stays_out_of_repr_errors_and_dead_letters(logs: Any,
                                                                 unique: str) -> None:
    """A handler fails with the adapter's own error (a closed broker's BrokerClosed
    quotes the broker's repr); the dead letter's error message, reason and traceback
    as stored on NATS never hold the password."""
    require_library("nats", "NatsJetStreamBroker")
    url = services.require("nats")
    from msgpatterns.aio import ThreadedAsyncBroker
    from msgpatterns.brokers import NatsJetStreamBroker

    with_password = url.replace("nats://", f"nats://alice:{SECRET}@", 1)
    topic = f"redact-{unique}"
    try:
        with NatsJetStreamBroker(with_password) as broker:
            assert SECRET not in repr(broker) and "alice:***@" in repr(broker)
            assert SECRET not in repr(ThreadedAsyncBroker(broker))
            gone = NatsJetStreamBroker(with_password)
            gone.close()

            def handler(message: Any) -> None:
                gone.publish(topic, b"x")  # raises BrokerClosed naming the broker

            broker.publish(topic, b"m")
            consumer = Consumer(broker, handler, topics=[topic], group="g",
                                retry=RetryPolicy(max_attempts=1), poll_timeout=0.05)
            consumer.run_until_idle(timeout=30)
            [dead] = broker.list_dead_letters(topic, "g")
        stored = " ".join([dead.error_message, dead.reason, dead.traceback])
        assert "BrokerClosed" in dead.error_type and "alice:***@" in stored
        assert SECRET not in stored
    finally:
        delete_nats_stream(url, topic)


def test_async_nats_repr_and_connect_error_hide_the_password(logs: Any) -> None:
    require_library("nats", "AsyncNatsJetStreamBroker")
    from msgpatterns.aio import AsyncNatsJetStreamBroker

    broker = AsyncNatsJetStreamBroker([f"nats://alice:{SECRET}@127.0.0.1:{dead_port()}",
                                       f"tls://{SECRET}@127.0.0.1:{dead_port()}"],
                                      connect_timeout=1.0)
    assert SECRET not in repr(broker)

    async def attempt() -> BaseException:
        try:
            await broker.fetch("t", "g", timeout=0.1)
        except BrokerError as exc:
            return exc
        finally:
            await broker.close()
        raise AssertionError("connected to a dead port")

    assert SECRET not in everything_about(asyncio.run(attempt()))


@pytest.mark.nats
def test_async_nats_password_stays_out_of_repr_errors_and_dead_letters(
        logs: Any, unique: str) -> None:
    """As the sync test: a handler of the native async adapter fails with a closed
    broker's BrokerClosed; nothing stored or shown holds the password."""
    require_library("nats", "AsyncNatsJetStreamBroker")
    url = services.require("nats")
    from msgpatterns.aio import AsyncConsumer, AsyncNatsJetStreamBroker
    from msgpatterns.brokers import NatsJetStreamBroker

    with_password = url.replace("nats://", f"nats://alice:{SECRET}@", 1)
    topic = f"redact-{unique}"

    async def run() -> None:
        async with AsyncNatsJetStreamBroker(with_password) as broker:
            assert SECRET not in repr(broker) and "alice:***@" in repr(broker)
            gone = AsyncNatsJetStreamBroker(with_password)
            await gone.close()

            async def handler(message: Any) -> None:
                await gone.publish(topic, b"x")  # raises BrokerClosed naming the broker

            await broker.publish(topic, b"m")
            consumer = AsyncConsumer(broker, handler, topics=[topic], group="g",
                                     retry=RetryPolicy(max_attempts=1), poll_timeout=0.05)
            await consumer.run_until_idle(timeout=30)

    try:
        asyncio.run(run())
        with NatsJetStreamBroker(url) as admin:
            [dead] = admin.list_dead_letters(topic, "g")
        stored = " ".join([dead.error_message, dead.reason, dead.traceback])
        assert "BrokerClosed" in dead.error_type and "alice:***@" in stored
        assert SECRET not in stored and SECRET not in logs.text
    finally:
        delete_nats_stream(url, topic)


@pytest.mark.nats
def test_nats_password_stays_out_of_spans(unique: str) -> None:
    """The span of a delivery whose handler failed with the adapter's error: its
    status and exception event hold the error text, never the password."""
    require_library("nats", "NatsJetStreamBroker")
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from msgpatterns.brokers import NatsJetStreamBroker
    from msgpatterns.observability import instrument, uninstrument

    url = services.require("nats")
    with_password = url.replace("nats://", f"nats://alice:{SECRET}@", 1)
    topic = f"redact-span-{unique}"
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    instrument(tracer_provider=provider)
    try:
        with NatsJetStreamBroker(with_password) as broker:
            gone = NatsJetStreamBroker(with_password)
            gone.close()

            def handler(message: Any) -> None:
                gone.publish(topic, b"x")

            broker.publish(topic, b"m")
            Consumer(broker, handler, topics=[topic], group="g",
                     retry=RetryPolicy(max_attempts=1),
                     poll_timeout=0.05).run_until_idle(timeout=30)
    finally:
        uninstrument()
        delete_nats_stream(url, topic)
    shown = []
    for span in spans.get_finished_spans():
        shown.append(str(span.status.description))
        shown += [str(dict(event.attributes or {})) for event in span.events]
        shown.append(str(dict(span.attributes or {})))
    assert any("BrokerClosed" in text or "is closed" in text for text in shown), shown
    assert all(SECRET not in text for text in shown)


# -- Kafka -------------------------------------------------------------------------------


@pytest.mark.kafka
def test_kafka_url_credentials_are_refused_without_showing_them(logs: Any) -> None:
    """Before: ``kafka://u:pw@host`` became ``bootstrap.servers=u:pw@host`` - in the
    repr, in errors and in librdkafka's own log lines."""
    require_library("confluent_kafka", "KafkaBroker")
    from msgpatterns.brokers import KafkaBroker

    with pytest.raises(ConfigurationError) as caught:
        KafkaBroker(f"kafka://alice:{SECRET}@127.0.0.1:{dead_port()}", connect_timeout=1)
    text = everything_about(caught.value)
    assert SECRET not in text and "sasl.password" in text


@pytest.mark.kafka
def test_aiokafka_url_credentials_are_refused_without_showing_them(logs: Any) -> None:
    require_library("aiokafka", "AIOKafkaBroker")
    from msgpatterns.aio.kafka_native import AIOKafkaBroker

    with pytest.raises(ConfigurationError) as caught:
        AIOKafkaBroker(f"kafka://alice:{SECRET}@127.0.0.1:{dead_port()}")
    assert SECRET not in everything_about(caught.value)


@pytest.mark.kafka
def test_cli_debug_dlq_on_a_kafka_url_with_a_password_never_prints_it() -> None:
    require_library("confluent_kafka", "KafkaBroker")
    done = subprocess.run(
        [sys.executable, "-m", "msgpatterns", "--debug", "dlq", "list",
         f"kafka://alice:{SECRET}@127.0.0.1:{dead_port()}", "--topic", "orders"],
        capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert SECRET not in done.stderr + done.stdout, done.stderr


# -- RabbitMQ ------------------------------------------------------------------------------


@pytest.mark.rabbitmq
def test_rabbitmq_wrong_password_and_dead_port_hide_the_password(
        rabbitmq_url: str, logs: Any) -> None:
    require_library("pika", "RabbitMQBroker")
    from msgpatterns.brokers import RabbitMQBroker

    wrong = rabbitmq_url.replace("guest:guest@", f"guest:{SECRET}@", 1)
    assert SECRET in wrong
    for url in (wrong, f"amqp://guest:{SECRET}@127.0.0.1:{dead_port()}/"):
        with pytest.raises(BrokerError) as caught:
            _subscribe_once(RabbitMQBroker, url, connect_timeout=2)
        assert SECRET not in everything_about(caught.value)


@pytest.mark.rabbitmq
def test_async_rabbitmq_wrong_password_and_dead_port_hide_the_password(
        rabbitmq_url: str, logs: Any) -> None:
    require_library("aio_pika", "AsyncRabbitMQBroker")
    from msgpatterns.aio.rabbitmq import AsyncRabbitMQBroker

    wrong = rabbitmq_url.replace("guest:guest@", f"guest:{SECRET}@", 1)

    async def attempt(url: str) -> BaseException:
        broker = AsyncRabbitMQBroker(url, connect_timeout=2)
        assert SECRET not in repr(broker)
        try:
            await broker.subscribe(f"redact-{uuid.uuid4().hex[:8]}", "g")
        except BrokerError as exc:
            return exc
        finally:
            await broker.close()
        raise AssertionError("connected with a wrong password")

    for url in (wrong, f"amqp://guest:{SECRET}@127.0.0.1:{dead_port()}/"):
        assert SECRET not in everything_about(asyncio.run(attempt(url)))


# -- Redis Streams -------------------------------------------------------------------------


@pytest.mark.redis
def test_redis_dead_port_hides_the_password(logs: Any) -> None:
    require_library("redis", "RedisStreamsBroker")
    from msgpatterns.brokers import RedisStreamsBroker

    url = f"redis://alice:{SECRET}@127.0.0.1:{dead_port()}/0"
    with pytest.raises(BrokerError) as caught:
        _subscribe_once(RedisStreamsBroker, url)
    assert SECRET not in everything_about(caught.value)


@pytest.mark.redis
def test_async_redis_dead_port_hides_the_password(logs: Any) -> None:
    require_library("redis", "AsyncRedisStreamsBroker")
    from msgpatterns.aio.redis_streams import AsyncRedisStreamsBroker

    url = f"redis://alice:{SECRET}@127.0.0.1:{dead_port()}/0"

    async def attempt() -> BaseException:
        broker = AsyncRedisStreamsBroker(url)
        assert SECRET not in repr(broker)
        try:
            await broker.fetch(f"redact-{uuid.uuid4().hex[:8]}", "g", timeout=0.1)
        except BrokerError as exc:
            return exc
        finally:
            await broker.close()
        raise AssertionError("fetched from a dead port")

    assert SECRET not in everything_about(asyncio.run(attempt()))
