"""Parity on a real Redis: the consumer-level behaviours with the sync
:class:`~msgpatterns.brokers.RedisStreamsBroker` under ``Consumer`` and the
:class:`~msgpatterns.aio.AsyncRedisStreamsBroker` under ``AsyncConsumer`` (same wire
format: one sync publisher feeds both) - settling, retries and dead letters, a stop
that strands nothing, batch handlers, ``max_message_bytes``, ``@idempotent``,
telemetry and health - one test body each."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from msgpatterns import Backoff, Message, RetryPolicy
from msgpatterns.brokers import RedisStreamsBroker
from two_drivers import Driver, Otel, Until, eventually

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

QUICK = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(0.2), local_retries=0)


@pytest.fixture
def stream(redis_url: str) -> Iterator[str]:
    name = f"parity-{uuid.uuid4().hex[:10]}"
    yield name
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{name}*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def publisher(redis_url: str) -> Iterator[RedisStreamsBroker]:
    with RedisStreamsBroker(redis_url) as broker:
        yield broker


def pending(redis_url: str, stream: str, group: str = "g") -> int:
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        return int(client.xpending(stream, group)["pending"])
    finally:
        client.close()


def dead_letters(publisher: RedisStreamsBroker, stream: str) -> list[Any]:
    admin = publisher.dead_letter_admin()
    try:
        return list(admin.list_dead_letters(stream, "g"))
    finally:
        admin.close()


def test_acks_retries_and_dead_letters(driver: Driver, redis_url: str, stream: str,
                                       publisher: RedisStreamsBroker) -> None:
    for body in (b"fine", b"flaky", b"poison"):
        publisher.publish(stream, body)
    done: list[tuple[bytes, int]] = []

    def body(message: Message) -> None:
        if message.raw_body == b"poison" or (message.raw_body == b"flaky"
                                             and message.attempt < 2):
            raise ValueError(f"boom {message.attempt}")
        done.append((message.raw_body, message.attempt))

    with driver.redis_broker(redis_url) as broker:
        stats = driver.consumer(broker, driver.handler(body), topics=[stream],
                                retry=QUICK, poll_timeout=0.05).consume(3)
    assert sorted(done) == [(b"fine", 1), (b"flaky", 2)]
    assert (stats.acked, stats.redelivered, stats.dead_lettered) == (2, 3, 1)
    [record] = dead_letters(publisher, stream)
    assert record.attempts == 3 and record.message.raw_body == b"poison"
    assert pending(redis_url, stream) == 0


def test_a_stop_strands_nothing_and_the_next_consumer_gets_it(
        driver: Driver, redis_url: str, stream: str, publisher: RedisStreamsBroker) -> None:
    for i in range(5):
        publisher.publish(stream, str(i).encode())
    entered = threading.Event()
    release = threading.Event()

    def body(message: Message) -> Any:
        entered.set()
        yield Until(release.is_set, timeout=5)

    with driver.redis_broker(redis_url) as broker:
        consumer = driver.consumer(broker, driver.handler(body), topics=[stream],
                                   poll_timeout=0.05)
        consumer.start()
        assert entered.wait(10)
        threading.Timer(1.0, release.set).start()
        assert consumer.stop(0.05) is False
        stats = consumer.stats
        assert stats.acked == 0 and stats.released == stats.fetched > 0
    eventually(lambda: pending(redis_url, stream) == 0)  # handed back, not left pending
    seen: list[bytes] = []
    with driver.redis_broker(redis_url) as broker:
        driver.consumer(broker, driver.handler(lambda m: seen.append(m.raw_body)),
                        topics=[stream], poll_timeout=0.05).consume(5)
    assert sorted(seen) == [str(i).encode() for i in range(5)]  # each once, none lost
    eventually(lambda: pending(redis_url, stream) == 0)


def test_a_batch_handler(driver: Driver, redis_url: str, stream: str,
                         publisher: RedisStreamsBroker) -> None:
    ids = publisher.publish_many(stream, [f"m{i}".encode() for i in range(20)])
    got: list[str | None] = []
    sizes: list[int] = []

    def body(messages: list[Message]) -> None:
        sizes.append(len(messages))
        got.extend(m.id for m in messages)

    with driver.redis_broker(redis_url) as broker:
        driver.consumer(broker, driver.handler(body), topics=[stream], batch=True,
                        fetch_batch=20, poll_timeout=0.05).consume(20)
    assert sorted(got) == sorted(ids) and max(sizes) > 1
    eventually(lambda: pending(redis_url, stream) == 0)


def test_max_message_bytes_dead_letters_the_big_one_and_goes_on(
        driver: Driver, redis_url: str, stream: str, publisher: RedisStreamsBroker) -> None:
    for body in (b"small-1", b"B" * 5000, b"small-2"):
        publisher.publish(stream, body)
    handled: list[bytes] = []

    with driver.redis_broker(redis_url, max_message_bytes=1000) as broker:
        consumer = driver.consumer(broker, driver.handler(lambda m: handled.append(m.raw_body)),
                                   topics=[stream], poll_timeout=0.05)
        consumer.start()
        try:
            eventually(lambda: len(handled) == 2)
            publisher.publish(stream, b"later")  # the consumer goes on
            eventually(lambda: len(handled) == 3)
            assert consumer.health().running
        finally:
            consumer.stop(10)
    assert handled == [b"small-1", b"small-2", b"later"]
    [record] = dead_letters(publisher, stream)
    assert "max_message_bytes=1000" in record.reason


def test_idempotent_handlers_skip_what_is_done(driver: Driver, redis_url: str, stream: str,
                                               publisher: RedisStreamsBroker,
                                               tmp_path: Path) -> None:
    for i in range(6):
        publisher.publish(stream, b"x", key=f"k{i % 3}")  # each key twice
    runs: list[str | None] = []
    with driver.checker("redis", tmp_path) as checker, \
            driver.redis_broker(redis_url) as broker:
        handler = driver.idempotent(checker, lambda m: runs.append(m.key))
        stats = driver.consumer(broker, handler, topics=[stream], workers=1,
                                max_in_flight=1, poll_timeout=0.05).consume(6)
        assert checker.stats.duplicates == 3
    assert sorted(runs) == ["k0", "k1", "k2"] and stats.acked == 6


def test_spans_metrics_and_health(driver: Driver, redis_url: str, stream: str,
                                  publisher: RedisStreamsBroker, otel: Otel) -> None:
    for i in range(4):
        publisher.publish(stream, str(i).encode(), key=f"k{i}")

    def body(message: Message) -> None:
        if message.raw_body == b"1" and message.attempt == 1:
            raise ValueError("once")

    with driver.redis_broker(redis_url) as broker:
        consumer = driver.consumer(broker, driver.handler(body), topics=[stream],
                                   retry=QUICK, poll_timeout=0.05)
        consumer.start()
        try:
            eventually(lambda: consumer.stats.acked == 4)
            health = consumer.health()
            assert health.ready and health.last_fetch_ok and health.in_flight == 0
        finally:
            consumer.stop(10)
        stats = consumer.stats
    spans = otel.finished()
    assert len(spans) == 5 == stats.acked + stats.failed
    assert {s.name for s in spans} == {f"process {stream}"}
    assert {s.attributes["messaging.system"] for s in spans} == {"redis"}
    assert otel.total("msgpatterns.consumer.fetched") == stats.fetched == 5
    assert otel.total("msgpatterns.consumer.deliveries",
                      **{"msgpatterns.outcome": "retried_later"}) == 1
