"""Parity on a real NATS JetStream: the consumer-level behaviours with the sync
:class:`~msgpatterns.brokers.NatsJetStreamBroker` under ``Consumer`` and the native
:class:`~msgpatterns.aio.AsyncNatsJetStreamBroker` under ``AsyncConsumer`` (same wire
format: one sync publisher feeds both) - settling, retries and dead letters, a stop
that strands nothing (handed back at once, not left to ``ack_wait``), batch handlers,
``max_message_bytes`` - one test body each."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from broker_harness import delete_nats_stream, require_library
from msgpatterns import Backoff, Message, RetryPolicy
from msgpatterns.testing import services
from two_drivers import Driver, Until, eventually

pytestmark = [pytest.mark.nats, pytest.mark.timeout(120)]

QUICK = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(0.2), local_retries=0)
#: Far longer than any test: a delivery comes back only if it was handed back.
AFTER_THE_TEST = 120.0


@pytest.fixture
def nats_url() -> str:
    require_library("nats", "NatsJetStreamBroker")
    return services.require("nats")


@pytest.fixture
def topic(nats_url: str) -> Iterator[str]:
    name = f"parity-{uuid.uuid4().hex[:10]}"
    yield name
    delete_nats_stream(nats_url, name)


@pytest.fixture
def publisher(nats_url: str) -> Iterator[Any]:
    from msgpatterns.brokers import NatsJetStreamBroker

    with NatsJetStreamBroker(nats_url) as broker:
        yield broker


def unsettled(url: str, topic: str, group: str = "g") -> int:
    """Deliveries of ``group`` (its main and retry consumers) handed out and not acked."""
    import nats

    from msgpatterns.brokers import NatsJetStreamBroker

    async def read() -> int:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            stream = NatsJetStreamBroker.stream_name(topic)
            infos = [await js.consumer_info(stream, durable)
                     for durable in (group, f"{group}__retry")]
            return sum(info.num_ack_pending for info in infos)
        finally:
            await nc.close()

    return asyncio.run(read())


def dead_letters(publisher: Any, topic: str) -> list[Any]:
    return list(publisher.dead_letter_admin().list_dead_letters(topic, "g"))


def test_acks_retries_and_dead_letters(driver: Driver, nats_url: str, topic: str,
                                       publisher: Any) -> None:
    publisher.subscribe(topic, "g")
    for body in (b"fine", b"flaky", b"poison"):
        publisher.publish(topic, body)
    done: list[tuple[bytes, int]] = []

    def body(message: Message) -> None:
        if message.raw_body == b"poison" or (message.raw_body == b"flaky"
                                             and message.attempt < 2):
            raise ValueError(f"boom {message.attempt}")
        done.append((message.raw_body, message.attempt))

    with driver.nats_broker(nats_url) as broker:
        stats = driver.consumer(broker, driver.handler(body), topics=[topic],
                                retry=QUICK, poll_timeout=0.05).consume(3)
    assert sorted(done) == [(b"fine", 1), (b"flaky", 2)]
    assert (stats.acked, stats.redelivered, stats.dead_lettered) == (2, 3, 1)
    [record] = dead_letters(publisher, topic)
    assert record.attempts == 3 and record.message.raw_body == b"poison"
    eventually(lambda: unsettled(nats_url, topic) == 0)


def test_a_stop_strands_nothing_and_the_next_consumer_gets_it(
        driver: Driver, nats_url: str, topic: str, publisher: Any) -> None:
    publisher.subscribe(topic, "g")
    for i in range(5):
        publisher.publish(topic, str(i).encode())
    entered = threading.Event()
    release = threading.Event()

    def body(message: Message) -> Any:
        entered.set()
        yield Until(release.is_set, timeout=5)

    with driver.nats_broker(nats_url, visibility_timeout=AFTER_THE_TEST) as broker:
        consumer = driver.consumer(broker, driver.handler(body), topics=[topic],
                                   poll_timeout=0.05)
        consumer.start()
        assert entered.wait(10)
        threading.Timer(1.0, release.set).start()
        assert consumer.stop(0.05) is False
        stats = consumer.stats
        assert stats.acked == 0 and stats.released == stats.fetched > 0
    # close() NAKed what was handed out: back at once, not after ack_wait
    eventually(lambda: unsettled(nats_url, topic) == 0)
    seen: list[bytes] = []
    with driver.nats_broker(nats_url, visibility_timeout=AFTER_THE_TEST) as broker:
        driver.consumer(broker, driver.handler(lambda m: seen.append(m.raw_body)),
                        topics=[topic], poll_timeout=0.05).consume(5)
    assert sorted(seen) == [str(i).encode() for i in range(5)]  # each once, none lost
    eventually(lambda: unsettled(nats_url, topic) == 0)


def test_a_batch_handler(driver: Driver, nats_url: str, topic: str,
                         publisher: Any) -> None:
    publisher.subscribe(topic, "g")
    ids = publisher.publish_many(topic, [f"m{i}".encode() for i in range(20)])
    got: list[str | None] = []
    sizes: list[int] = []

    def body(messages: list[Message]) -> None:
        sizes.append(len(messages))
        got.extend(m.id for m in messages)

    with driver.nats_broker(nats_url) as broker:
        driver.consumer(broker, driver.handler(body), topics=[topic], batch=True,
                        fetch_batch=20, poll_timeout=0.05).consume(20)
    assert sorted(got) == sorted(ids) and max(sizes) > 1
    eventually(lambda: unsettled(nats_url, topic) == 0)


def test_max_message_bytes_dead_letters_the_big_one_and_goes_on(
        driver: Driver, nats_url: str, topic: str, publisher: Any) -> None:
    publisher.subscribe(topic, "g")
    for body in (b"small-1", b"B" * 5000, b"small-2"):
        publisher.publish(topic, body)
    handled: list[bytes] = []

    with driver.nats_broker(nats_url, max_message_bytes=1000) as broker:
        consumer = driver.consumer(broker, driver.handler(lambda m: handled.append(m.raw_body)),
                                   topics=[topic], poll_timeout=0.05)
        consumer.start()
        try:
            eventually(lambda: len(handled) == 2)
            publisher.publish(topic, b"later")  # the consumer goes on
            eventually(lambda: len(handled) == 3)
            assert consumer.health().running
        finally:
            consumer.stop(10)
    assert handled == [b"small-1", b"small-2", b"later"]
    [record] = dead_letters(publisher, topic)
    assert "max_message_bytes=1000" in record.reason
