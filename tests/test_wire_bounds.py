"""A due time or an attempt count from the wire is bounded by the consumer's own policy.

``x-msgpatterns-attempt`` and ``x-msgpatterns-retry-due-at`` are producer data. Inside
the library's limits (checked by ``header_problem``, tests/test_wire_headers.py) a
forged value used to be taken at its word: ``attempt: 9000`` dead-lettered a message
after one transient failure under ``RetryPolicy(max_attempts=5)``, a due time six days
out hid it for six days under a policy whose longest delay is a minute. Now an attempt
header beyond ``2 * max_attempts`` is ignored (the broker's own delivery count still
counts) and a due time beyond ``max_delay`` (plus clock skew) is due now - on every
adapter, through one pair of functions (``headers.trusted_attempt`` and
``headers.honoured_due_at``).

The shared functions are tested by property; each adapter's decoding without I/O; and
from the outside on the real servers: ``redis-cli XADD``, plain nats-py and pika
publishers and confluent-kafka's Producer (librdkafka mock cluster) feed a running
``Consumer`` whose handler fails once, transiently.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlparse

import pytest
from hypothesis import given
from hypothesis import strategies as st

from broker_harness import (
    KAFKA_TEST_CONSUMER,
    delete_nats_stream,
    delete_rabbitmq_topology,
    kafka_cluster,
    require_library,
)
from msgpatterns import Backoff, Consumer, InMemoryBroker, Message, NeedRetry, RetryPolicy
from msgpatterns import headers as h
from msgpatterns.brokers import codec
from msgpatterns.brokers.base import SupportsWireBounds
from msgpatterns.brokers.kafka._records import RecordView, judge
from msgpatterns.brokers.nats import _wire as nats_wire
from msgpatterns.brokers.rabbitmq._wire import message_of, message_of_plain
from msgpatterns.retry import Action
from msgpatterns.testing import services

pytestmark = [pytest.mark.timeout(120)]

SIX_DAYS = 6 * 86_400.0
#: A policy that allows 5 attempts and a minute's delay.
TIGHT = RetryPolicy(max_attempts=5, backoff=Backoff.fixed(0.05), local_retries=0,
                    max_delay=60)
BOUNDS = TIGHT.wire_bounds()


# -- the policy's bounds ----------------------------------------------------------------


def test_the_policy_gives_its_bounds() -> None:
    assert TIGHT.wire_bounds() == h.WireBounds(max_attempt=10, max_delay=60.0)
    assert RetryPolicy().wire_bounds() == h.WireBounds(32, h.MAX_RETRY_DELAY)
    assert RetryPolicy(max_attempts=9_000).wire_bounds().max_attempt == h.MAX_ATTEMPT
    assert RetryPolicy(max_delay=timedelta(days=30)).wire_bounds().max_delay == (
        h.MAX_RETRY_DELAY)
    assert RetryPolicy(max_delay=timedelta(minutes=2)).max_delay == 120.0


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "60"])
def test_a_bad_max_delay_is_refused(bad: Any) -> None:
    from msgpatterns.errors import ConfigurationError

    with pytest.raises(ConfigurationError):
        RetryPolicy(max_delay=bad)


def _failed(attempt: int) -> Message:
    return Message(b"x", id="m", attempt=attempt)


@given(delay=st.floats(0, 1e6), max_delay=st.floats(0, 1e5),
       attempt=st.integers(1, 4))
def test_max_delay_caps_every_redelivery_delay(delay: float, max_delay: float,
                                               attempt: int) -> None:
    policy = RetryPolicy(max_attempts=5, backoff=Backoff.fixed(delay), local_retries=0,
                         max_delay=max_delay)
    for error in (RuntimeError("boom"), NeedRetry(delay=delay)):
        verdict = policy.decide(_failed(attempt), error)
        assert verdict.action is Action.REDELIVER
        assert verdict.delay == min(delay, max_delay)


def test_without_max_delay_delays_are_as_before() -> None:
    verdict = RetryPolicy().decide(_failed(1), NeedRetry(delay=30 * 86_400))
    assert verdict.delay == 30 * 86_400


# -- the shared functions (properties) ----------------------------------------------------


bounds_st = st.builds(h.WireBounds, max_attempt=st.integers(1, h.MAX_ATTEMPT),
                      max_delay=st.floats(0, h.MAX_RETRY_DELAY))
header_text = st.one_of(st.integers(-10, 3 * h.MAX_ATTEMPT).map(str),
                        st.sampled_from(["", "abc", "1.5", " 3", "nan", "inf", "-0"]),
                        st.text(max_size=8))


@given(value=header_text, bounds=bounds_st, redeliveries=st.integers(-3, 10_000))
def test_an_attempt_header_counts_only_within_the_bound(
        value: str, bounds: h.WireBounds, redeliveries: int) -> None:
    headers = {h.ATTEMPT: value}
    trusted = h.trusted_attempt(headers, bounds)
    assert 1 <= trusted <= bounds.max_attempt
    try:
        number: int | None = int(value)
    except ValueError:
        number = None
    if number is not None and 1 <= number <= bounds.max_attempt:
        assert trusted == number
    else:
        assert trusted == 1
    # the broker's own delivery count is never bounded
    assert codec.attempt_of(headers, redeliveries, bounds) == trusted + max(0, redeliveries)


@given(attempt=st.integers(1, 200), max_attempts=st.integers(1, 100))
def test_what_the_runtime_writes_is_trusted(attempt: int, max_attempts: int) -> None:
    """An attempt the runtime writes (at most ``max_attempts``) always counts."""
    if attempt <= max_attempts:
        bounds = RetryPolicy(max_attempts=max_attempts).wire_bounds()
        assert h.trusted_attempt({h.ATTEMPT: str(attempt)}, bounds) == attempt


@given(offset=st.one_of(st.floats(-1e9, 1e9), st.sampled_from(
           [float("inf"), float("-inf"), float("nan")])),
       bounds=bounds_st, now=st.floats(0, 4e9))
def test_a_due_time_never_hides_a_message_beyond_the_bound(
        offset: float, bounds: h.WireBounds, now: float) -> None:
    due = now + offset
    honoured = h.honoured_due_at(due, now, bounds)
    if honoured is not None:
        assert honoured == due
        assert 0 < honoured - now <= bounds.max_delay + h.CLOCK_SKEW
    else:
        assert not (due > now and due - now <= bounds.max_delay + h.CLOCK_SKEW)
    assert h.honoured_due_at(None, now, bounds) is None


@given(delay=st.floats(0, 1e7), max_delay=st.one_of(st.none(), st.floats(0, 1e6)),
       skew=st.floats(-h.CLOCK_SKEW + 0.001, 0))
def test_a_due_time_the_policy_writes_is_honoured(delay: float, max_delay: float | None,
                                                  skew: float) -> None:
    """The consumer never distrusts its own writes: a redelivery after the policy's
    delay, written on a clock up to CLOCK_SKEW ahead, is held until it is due.
    (Epoch seconds are floats with ~0.2 us steps, so the exact edge is not tested.)"""
    policy = RetryPolicy(backoff=Backoff.fixed(delay), local_retries=0,
                         max_delay=max_delay)
    verdict = policy.decide(_failed(1), RuntimeError("boom"))
    if verdict.delay > h.MAX_RETRY_DELAY:
        return  # the library's own wire limit (header_problem) - tests/test_wire_headers.py
    reader_now = 1_700_000_000.0
    due = reader_now - skew + verdict.delay
    if due > reader_now:
        assert h.honoured_due_at(due, reader_now, policy.wire_bounds()) == due


# -- adapters hold each group's bounds ------------------------------------------------------


def test_the_consumer_tells_its_broker_its_bounds() -> None:
    broker = InMemoryBroker()
    assert isinstance(broker, SupportsWireBounds)
    assert broker.wire_bounds("g") == h.WIRE_LIMITS
    Consumer(broker, lambda m: None, topics=["t"], group="g", retry=TIGHT)
    assert broker.wire_bounds("g") == BOUNDS
    assert broker.wire_bounds("other") == h.WIRE_LIMITS
    # two consumers of one group: what either writes is trusted
    Consumer(broker, lambda m: None, topics=["t"], group="g",
             retry=RetryPolicy(max_attempts=3, max_delay=600))
    assert broker.wire_bounds("g") == h.WireBounds(10, 600.0)


def test_the_async_face_tells_the_sync_broker() -> None:
    from msgpatterns.aio import AsyncConsumer, ThreadedAsyncBroker

    sync = InMemoryBroker()
    broker = ThreadedAsyncBroker(sync)

    async def handler(message: Message) -> None:
        return None

    AsyncConsumer(broker, handler, topics=["t"], group="g", retry=TIGHT)
    assert broker.wire_bounds("g") == BOUNDS
    assert sync.wire_bounds("g") == BOUNDS


# -- each adapter's decoding (no I/O) ----------------------------------------------------------


def test_nats_judge_bounds_attempt_and_due_time() -> None:
    now = time.time()

    def judge_one(headers: dict[str, str], deliveries: int = 1) -> nats_wire.Verdict:
        return nats_wire.judge(b"x", headers, topic="t", stream="t", sequence=1,
                               deliveries=deliveries, published=None, now=now, limit=None,
                               bounds=BOUNDS)

    forged = judge_one({h.ATTEMPT: "9000"}, deliveries=3)
    assert forged.message is not None and forged.message.attempt == 3  # 1 + 2 redeliveries
    assert judge_one({h.ATTEMPT: "4"}, deliveries=3).message.attempt == 6  # type: ignore[union-attr]
    hidden = judge_one({h.RETRY_DUE_AT: repr(now + SIX_DAYS)})
    assert hidden.wait is None and hidden.message is not None
    assert judge_one({h.RETRY_DUE_AT: repr(now + 30)}).wait == pytest.approx(30)
    # without a policy, the library's limits (a 6-day due time is within them)
    plain = nats_wire.judge(b"x", {h.RETRY_DUE_AT: repr(now + SIX_DAYS)}, topic="t",
                            stream="t", sequence=1, deliveries=1, published=None, now=now,
                            limit=None)
    assert plain.wait == pytest.approx(SIX_DAYS)


def _record(topic: str, headers: dict[str, str]) -> RecordView:
    return RecordView(read_topic=topic, partition=0, offset=7, key=None, value=b"x",
                      headers=tuple((k, v.encode()) for k, v in headers.items()),
                      timestamp_ms=None)


def test_kafka_judge_bounds_attempt_and_due_time() -> None:
    now = time.time()
    retry = {"t.retry": "t"}
    forged = judge(_record("t", {h.ATTEMPT: "9000"}), retry, "g", now, limit=None,
                   bounds=BOUNDS)
    assert forged.action == "deliver" and forged.message is not None
    assert forged.message.attempt == 1
    hidden = judge(_record("t.retry", {h.RETRY_DUE_AT: repr(now + SIX_DAYS),
                                       codec.GROUP: "g"}), retry, "g", now, limit=None,
                   bounds=BOUNDS)
    assert hidden.action == "deliver"
    soon = judge(_record("t.retry", {h.RETRY_DUE_AT: repr(now + 30), codec.GROUP: "g"}),
                 retry, "g", now, limit=None, bounds=BOUNDS)
    assert soon.action == "wait" and soon.due_at == pytest.approx(now + 30)


@pytest.mark.parametrize("decode", [message_of, message_of_plain])
def test_rabbitmq_decoding_bounds_the_header_not_the_delivery_count(
        decode: Callable[..., Message]) -> None:
    def props(headers: dict[str, Any]) -> Any:
        return SimpleNamespace(headers=headers, message_id=None, timestamp=None)

    method = SimpleNamespace(redelivered=True)
    forged = decode("t", method, props({h.ATTEMPT: "9000", "x-delivery-count": 7}), b"x",
                    BOUNDS)
    assert forged.attempt == 1 + 7  # a quorum queue's count is the server's own
    real = decode("t", method, props({h.ATTEMPT: "5", "x-delivery-count": 7}), b"x", BOUNDS)
    assert real.attempt == 5 + 7
    native = decode("t", method, props({"x-delivery-count": 40}), b"x", BOUNDS)
    assert native.attempt == 41


def test_redis_decoding_bounds_the_header_not_xpending() -> None:
    from msgpatterns.brokers.redis._wire import EntryDecoder

    decoder = EntryDecoder("c", None, lambda m, r: None, lambda group: BOUNDS)
    fields = {b"body": b"x", b"headers": json.dumps({h.ATTEMPT: "9000"}).encode()}
    forged = decoder.message("t", "t", False, "g", b"1-0", fields, 4)
    assert forged is not None and forged.attempt == 1 + 3
    fields = {b"body": b"x", b"headers": json.dumps({h.ATTEMPT: "3"}).encode()}
    real = decoder.message("t", "t", False, "g", b"1-1", fields, 4)
    assert real is not None and real.attempt == 3 + 3


# -- from the outside, on the real servers ------------------------------------------------------


class FailsOnce:
    """A handler that fails each message's first delivery with a transient error."""

    def __init__(self, expected: int) -> None:
        self.seen: dict[bytes, list[int]] = {}
        self.done: set[bytes] = set()
        self.expected = expected
        self.all_done = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, message: Message) -> None:
        body = bytes(message.raw_body)
        with self.lock:
            attempts = self.seen.setdefault(body, [])
            attempts.append(message.attempt)
            if len(attempts) == 1:
                raise ConnectionError("transient")
            self.done.add(body)
            if len(self.done) >= self.expected:
                self.all_done.set()


def run_consumer(broker: Any, topic: str, group: str, handler: FailsOnce,
                 publish: Callable[[], None], within: float = 30.0) -> Consumer:
    consumer = Consumer(broker, handler, topics=[topic], group=group, retry=TIGHT,
                        poll_timeout=0.2)
    consumer.start()
    try:
        publish()
        assert handler.all_done.wait(within), (handler.seen, consumer.stats)
    finally:
        consumer.stop(10)
        consumer.close()
    return consumer


def run_async_consumer(broker: Any, topic: str, group: str, handler: FailsOnce,
                       publish: Callable[[], None], within: float = 30.0) -> Any:
    """:func:`run_consumer` with the asyncio driver on an async adapter."""
    from msgpatterns.aio import AsyncConsumer

    async def handle(message: Message) -> None:
        handler(message)

    async def run() -> Any:
        await broker.subscribe(topic, group)  # the group exists before anything is sent
        consumer = AsyncConsumer(broker, handle, topics=[topic], group=group, retry=TIGHT,
                                 poll_timeout=0.2)
        await consumer.start()
        try:
            await asyncio.to_thread(publish)
            done = await asyncio.to_thread(handler.all_done.wait, within)
            assert done, (handler.seen, consumer.stats)
        finally:
            await consumer.stop(10)
            await consumer.aclose()
            await broker.close()
        return consumer

    return asyncio.run(run())


def _assert_retried(handler: FailsOnce, consumer: Any, bodies: list[bytes]) -> None:
    assert handler.done == set(bodies), handler.seen
    assert consumer.stats.dead_lettered == 0, handler.seen
    for body in bodies:
        assert len(handler.seen[body]) == 2, handler.seen


@pytest.fixture
def redis_topic(redis_url: str, unique: str) -> Iterator[tuple[str, str]]:
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed")
    require_library("redis", "RedisStreamsBroker")
    topic, group = f"bounds-{unique}", "g"
    yield topic, group
    import redis

    client = redis.Redis.from_url(redis_url)
    client.delete(topic, f"{topic}:retry:{group}", f"{topic}:delayed:{group}", f"{topic}:dlq")
    client.close()


def redis_cli_xadd(url: str, topic: str, body: str, headers: dict[str, str]) -> None:
    """``redis-cli XADD``: an entry as another team's script would write it."""
    where = urlparse(url)
    subprocess.run(["redis-cli", "-h", where.hostname or "127.0.0.1", "-p",
                    str(where.port or 6379), "-n", (where.path or "/0").strip("/") or "0",
                    "XADD", topic, "*", "body", body, "headers", json.dumps(headers)],
                   check=True, timeout=30, capture_output=True)


@pytest.mark.redis
def test_redis_cli_forged_attempt_gets_its_retries(
        redis_url: str, redis_topic: tuple[str, str]) -> None:
    """Before: ``attempt: 9000`` - dead-lettered after one transient failure."""
    from msgpatterns.brokers import RedisStreamsBroker

    topic, group = redis_topic
    with RedisStreamsBroker(redis_url, visibility_timeout=30) as broker:
        broker.subscribe(topic, group)
        handler = FailsOnce(1)
        consumer = run_consumer(broker, topic, group, handler, lambda: redis_cli_xadd(
            redis_url, topic, "forged", {h.ATTEMPT: "9000", "plain": "kept"}))
    _assert_retried(handler, consumer, [b"forged"])
    assert handler.seen[b"forged"] == [1, 2]


@pytest.mark.redis
def test_redis_cli_forged_attempt_on_the_async_adapter(
        redis_url: str, redis_topic: tuple[str, str]) -> None:
    from msgpatterns.aio.redis_streams import AsyncRedisStreamsBroker

    topic, group = redis_topic
    handler = FailsOnce(1)
    consumer = run_async_consumer(
        AsyncRedisStreamsBroker(redis_url, visibility_timeout=30), topic, group, handler,
        lambda: redis_cli_xadd(redis_url, topic, "forged", {h.ATTEMPT: "9000"}))
    _assert_retried(handler, consumer, [b"forged"])
    assert handler.seen[b"forged"] == [1, 2]


@pytest.fixture
def nats_topic(unique: str) -> Iterator[tuple[str, str]]:
    require_library("nats", "NatsJetStreamBroker")
    url = services.require("nats")
    topic = f"bounds-{unique}"
    yield url, topic
    delete_nats_stream(url, topic)


def nats_publish(url: str, subject: str, items: list[tuple[bytes, dict[str, str]]]) -> None:
    import nats

    async def publish() -> None:
        nc = await nats.connect(url)
        try:
            js = nc.jetstream()
            for body, headers in items:
                await js.publish(subject, body, headers=headers)
        finally:
            await nc.close()

    asyncio.run(publish())


@pytest.mark.nats
def test_nats_forged_attempt_and_far_due_time(nats_topic: tuple[str, str]) -> None:
    """Before: ``attempt: 9000`` was dead-lettered after one transient failure and a
    due time six days out hid the message for six days."""
    from msgpatterns.brokers import NatsJetStreamBroker

    url, topic = nats_topic
    items = [(b"attempt-9000", {h.ATTEMPT: "9000"}),
             (b"due-6d", {h.RETRY_DUE_AT: repr(time.time() + SIX_DAYS)})]
    with NatsJetStreamBroker(url) as broker:
        broker.subscribe(topic, "g")
        handler = FailsOnce(len(items))
        consumer = run_consumer(broker, topic, "g", handler,
                                lambda: nats_publish(url, topic, items))
    _assert_retried(handler, consumer, [body for body, _ in items])


@pytest.mark.nats
def test_nats_forged_attempt_and_far_due_time_on_the_async_adapter(
        nats_topic: tuple[str, str]) -> None:
    """The same on the native asyncio adapter (it reads its group's bounds as the
    sync one does: one JetStream session)."""
    from msgpatterns.aio import AsyncNatsJetStreamBroker

    url, topic = nats_topic
    items = [(b"attempt-9000", {h.ATTEMPT: "9000"}),
             (b"due-6d", {h.RETRY_DUE_AT: repr(time.time() + SIX_DAYS)})]
    handler = FailsOnce(len(items))
    consumer = run_async_consumer(AsyncNatsJetStreamBroker(url), topic, "g", handler,
                                  lambda: nats_publish(url, topic, items))
    _assert_retried(handler, consumer, [body for body, _ in items])


@pytest.fixture
def rabbit_names(rabbitmq_url: str, unique: str) -> Iterator[tuple[str, str]]:
    require_library("pika", "RabbitMQBroker")
    topic, group = f"bounds-{unique}", f"g-{unique}"
    yield topic, group
    delete_rabbitmq_topology(rabbitmq_url, topic, group)


def pika_publish(url: str, topic: str, body: bytes, headers: dict[str, str]) -> None:
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        conn.channel().basic_publish(topic, topic, body, pika.BasicProperties(headers=headers))
    finally:
        conn.close()


@pytest.mark.rabbitmq
def test_pika_forged_attempt_gets_its_retries(rabbitmq_url: str,
                                              rabbit_names: tuple[str, str]) -> None:
    from msgpatterns.brokers import RabbitMQBroker

    topic, group = rabbit_names
    with RabbitMQBroker(rabbitmq_url) as broker:
        broker.subscribe(topic, group)
        handler = FailsOnce(1)
        consumer = run_consumer(broker, topic, group, handler, lambda: pika_publish(
            rabbitmq_url, topic, b"attempt-9000", {h.ATTEMPT: "9000"}))
    _assert_retried(handler, consumer, [b"attempt-9000"])
    assert handler.seen[b"attempt-9000"] == [1, 2]


@pytest.mark.rabbitmq
def test_pika_forged_attempt_on_the_async_adapter(rabbitmq_url: str,
                                                  rabbit_names: tuple[str, str]) -> None:
    require_library("aio_pika", "AsyncRabbitMQBroker")
    from msgpatterns.aio.rabbitmq import AsyncRabbitMQBroker

    topic, group = rabbit_names
    handler = FailsOnce(1)
    consumer = run_async_consumer(AsyncRabbitMQBroker(rabbitmq_url), topic, group, handler,
                                  lambda: pika_publish(
                                      rabbitmq_url, topic, b"attempt-9000",
                                      {h.ATTEMPT: "9000"}))
    _assert_retried(handler, consumer, [b"attempt-9000"])
    assert handler.seen[b"attempt-9000"] == [1, 2]


@pytest.mark.kafka
def test_kafka_forged_attempt_and_far_due_time() -> None:
    from confluent_kafka import Producer

    from msgpatterns.brokers import KafkaBroker

    bootstrap = str(kafka_cluster().bootstrap_servers)
    topic, group = f"bounds-{uuid.uuid4().hex[:10]}", f"g-{uuid.uuid4().hex[:6]}"
    with KafkaBroker(bootstrap, consumer_config=KAFKA_TEST_CONSUMER) as broker:
        retry_topic = broker.retry_topic(topic)

        def produce() -> None:
            producer = Producer({"bootstrap.servers": bootstrap})
            producer.produce(topic, b"attempt-9000", partition=0,
                             headers=[(h.ATTEMPT, "9000")])
            producer.produce(retry_topic, b"due-6d", partition=0, headers=[
                (h.RETRY_DUE_AT, repr(time.time() + SIX_DAYS)), (codec.GROUP, group)])
            assert producer.flush(30) == 0

        handler = FailsOnce(2)
        consumer = run_consumer(broker, topic, group, handler, produce, within=60)
    _assert_retried(handler, consumer, [b"attempt-9000", b"due-6d"])



def test_an_ignored_header_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="msgpatterns.headers"):
        assert h.trusted_attempt({h.ATTEMPT: "9000"}, BOUNDS) == 1
        assert h.honoured_due_at(time.time() + SIX_DAYS, time.time(), BOUNDS) is None
        assert h.trusted_attempt({h.ATTEMPT: "3"}, BOUNDS) == 3
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert h.ATTEMPT in messages[0] and "9000" in messages[0] and "10" in messages[0]
    assert h.RETRY_DUE_AT in messages[1] and "60 s" in messages[1]


def test_an_ordered_topic_feed_passes_the_bounds_to_its_broker() -> None:
    from msgpatterns.ordering import MemoryRouteStore, OrderedTopic

    broker = InMemoryBroker(record_history=False)
    topic = OrderedTopic(broker, "bounded", routes=MemoryRouteStore(), logic_partitions=4)
    topic.create(physical=1)
    consumer = topic.consumer(lambda m: None, group="g", retry=TIGHT)
    try:
        assert broker.wire_bounds("g") == BOUNDS
    finally:
        consumer.close()
