"""FastStream on every broker (issue 23, item 6): Kafka (librdkafka mock cluster, with
FastStream's aiokafka broker), NATS JetStream and Redis list subscribers retry on the
policy's schedule and dead-letter where ``msgpatterns dlq`` reads; a Redis delayed retry
no longer holds up its subscriber; an unsupported subscriber is refused when the app
starts."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("faststream")

from faststream import AckPolicy
from faststream.redis import RedisBroker, StreamSub

from msgpatterns import Backoff, Reject, RetryPolicy
from msgpatterns.errors import ConfigurationError
from msgpatterns.integrations.faststream import Delivery, MsgpatternsMiddleware

DELAY = 0.3
POLICY = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(DELAY), local_retries=0)


async def until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, "timed out"
        await asyncio.sleep(0.02)


class Flaky:
    """Fails twice, then succeeds; rejects bodies with ``reject``."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float, str | None]] = []

    def handler(self) -> Callable[..., Any]:
        async def handle(body: dict[str, Any], delivery: Delivery) -> None:
            self.seen.append((delivery.attempt, time.monotonic(), delivery.id))
            if body.get("reject"):
                raise Reject(f"unknown order {body['n']}")
            if delivery.attempt < 3:
                raise TimeoutError("ledger busy")
        return handle

    def check_schedule(self, ids: tuple[str, ...] = ("flaky-1",)) -> None:
        for flaky_id in ids:
            flaky = [(a, t) for a, t, i in self.seen if i == flaky_id]
            assert [a for a, _ in flaky] == [1, 2, 3], (flaky_id, flaky)
            gaps = [b - a for (_, a), (_, b) in itertools.pairwise(flaky)]
            assert all(gap >= DELAY for gap in gaps), gaps  # never early


@pytest.mark.kafka
@pytest.mark.timeout(120)
def test_kafka_on_the_mock_cluster(unique: str) -> None:
    pytest.importorskip("aiokafka")
    from faststream.kafka import KafkaBroker

    from msgpatterns.brokers import KafkaBroker as AdapterBroker
    from msgpatterns.testing.kafka_mock import KafkaMockCluster

    cluster = KafkaMockCluster()
    topic = f"fs-{unique}"
    handler = Flaky()
    broker = KafkaBroker(cluster.bootstrap_servers, middlewares=[MsgpatternsMiddleware(POLICY)])
    broker.subscriber(topic, group_id="billing", auto_offset_reset="earliest",
                      ack_policy=AckPolicy.ACK)(handler.handler())

    async def scenario() -> None:
        async with broker:
            await broker.start()
            await broker.publish({"n": 1}, topic=topic, key=b"o-1",
                                 headers={"message_id": "flaky-1"})
            await broker.publish({"n": 2, "reject": True}, topic=topic, key=b"o-2",
                                 headers={"message_id": "reject-1"})
            await until(lambda: len(handler.seen) == 4)

    adapter = AdapterBroker(cluster.bootstrap_servers)
    try:
        asyncio.run(scenario())
        handler.check_schedule()
        assert {i for _, _, i in handler.seen} == {"flaky-1", "reject-1"}
        [record] = adapter.dead_letter_admin().list_dead_letters(topic)
        assert record.id == "reject-1"
        assert record.message.key == "o-2"
        assert record.reason == "rejected: unknown order 2"
        assert record.message.raw_body == b'{"n":2,"reject":true}'
    finally:
        adapter.close()
        cluster.close()


FLAKY = tuple(f"flaky-{n}" for n in range(1, 13))


@pytest.mark.nats
@pytest.mark.timeout(120)
def test_nats_jetstream(unique: str) -> None:
    from faststream.nats import JStream, NatsBroker, PullSub

    from msgpatterns.brokers import NatsJetStreamBroker
    from msgpatterns.testing import services

    url = services.require("nats")
    subject = f"fs_{unique}"
    stream = JStream(NatsJetStreamBroker.stream_name(subject),
                     subjects=[subject, NatsJetStreamBroker.dead_letter_subject(subject)])
    handler = Flaky()
    broker = NatsBroker(url, middlewares=[MsgpatternsMiddleware(POLICY)])
    broker.subscriber(subject, stream=stream, durable=f"billing_{unique}",
                      pull_sub=PullSub(batch_size=1, timeout=0.2))(handler.handler())

    async def scenario() -> None:
        async with broker:
            await broker.start()
            for n in FLAKY:
                await broker.publish({"n": n}, subject=subject, stream=stream.name,
                                     headers={"message_id": n})
            await broker.publish({"n": 2, "reject": True}, subject=subject,
                                 stream=stream.name, headers={"message_id": "reject-1"})
            await until(lambda: len(handler.seen) == 3 * len(FLAKY) + 1)

    adapter = NatsJetStreamBroker(url)
    try:
        asyncio.run(scenario())
        # Every message exactly attempts 1, 2, 3: the attempt rides in the copy's
        # headers (a 2.9 server's num_delivered can go backwards after a delayed NAK).
        handler.check_schedule(FLAKY)
        [record] = adapter.dead_letter_admin().list_dead_letters(subject)
        assert record.id == "reject-1"
        assert record.reason == "rejected: unknown order 2"
    finally:
        async def drop() -> None:
            import nats

            nc = await nats.connect(url)
            try:
                await nc.jetstream().delete_stream(stream.name)
            finally:
                await nc.close()

        adapter.close()
        asyncio.run(drop())


@pytest.mark.redis
@pytest.mark.timeout(60)
def test_redis_list_subscriber(redis_url: str, unique: str) -> None:
    import redis

    from msgpatterns.brokers import RedisStreamsBroker

    name = f"fs-list-{unique}"
    handler = Flaky()
    broker = RedisBroker(redis_url, middlewares=[MsgpatternsMiddleware(POLICY)])
    broker.subscriber(list=name)(handler.handler())

    async def scenario() -> None:
        async with broker:
            await broker.start()
            await broker.publish({"n": 1}, list=name, headers={"message_id": "flaky-1"})
            await broker.publish({"n": 2, "reject": True}, list=name,
                                 headers={"message_id": "reject-1"})
            await until(lambda: len(handler.seen) == 4)

    adapter = RedisStreamsBroker(redis_url)
    client = redis.Redis.from_url(redis_url)
    try:
        asyncio.run(scenario())
        handler.check_schedule()
        [record] = adapter.dead_letter_admin().list_dead_letters(name)
        assert record.id == "reject-1"
        assert record.reason == "rejected: unknown order 2"
        assert client.zcard(f"{name}:fs-delayed-list") == 0  # nothing left behind
    finally:
        adapter.close()
        client.delete(name, f"{name}:dlq", f"{name}:fs-delayed-list",
                      f"{name}:fs-delayed-list:data")
        client.close()


@pytest.mark.redis
@pytest.mark.timeout(60)
def test_a_redis_delayed_retry_does_not_hold_up_its_subscriber(redis_url: str,
                                                               unique: str) -> None:
    """The retry copy waits in Redis, not in the subscriber: the next message is
    handled while the failed one waits for its delay (before: after it)."""
    import redis

    stream = f"fs-hold-{unique}"
    order: list[str] = []
    entries_when_b_ran: list[int] = []
    client = redis.Redis.from_url(redis_url)
    policy = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(2.0), local_retries=0)
    broker = RedisBroker(redis_url, middlewares=[MsgpatternsMiddleware(policy)])

    @broker.subscriber(stream=StreamSub(stream, group="billing", consumer="c1"))
    async def handle(body: dict[str, Any], delivery: Delivery) -> None:
        order.append(f"{body['n']}@{delivery.attempt}")
        if body["n"] == "b":
            entries_when_b_ran.append(client.xlen(stream))
        if body["n"] == "a" and delivery.attempt == 1:
            raise TimeoutError("ledger busy")

    async def scenario() -> None:
        async with broker:
            await broker.start()
            await broker.publish({"n": "a"}, stream=stream)
            await until(lambda: len(order) == 1)  # a failed: its retry is due in 2 s
            await broker.publish({"n": "b"}, stream=stream)
            await until(lambda: len(order) == 3)

    try:
        asyncio.run(scenario())
        assert order == ["a@1", "b@1", "a@2"]
        # b ran while a's copy still waited for its delay (before: the subscriber held
        # a for the whole delay, added its copy, and only then read b)
        assert entries_when_b_ran == [2]
        assert client.xpending(stream, "billing")["pending"] == 0
    finally:
        client.delete(stream, f"{stream}:fs-delayed", f"{stream}:fs-delayed:data")
        client.close()


def test_an_unsupported_subscriber_is_refused_when_the_app_starts() -> None:
    from faststream import FastStream

    middleware = MsgpatternsMiddleware(POLICY)
    broker = RedisBroker("redis://127.0.0.1:1", middlewares=[middleware])
    broker.subscriber("news")(lambda body: None)  # a pub/sub channel: no ack
    broker.subscriber(stream=StreamSub("s", group="g", consumer="c", batch=True))(
        lambda body: None)
    app = FastStream(broker, on_startup=[lambda: middleware.check(broker)])

    with pytest.raises(ConfigurationError) as info:
        asyncio.run(app.start())
    text = str(info.value)
    assert "Redis pub/sub channels carry no acknowledgement" in text
    assert "batch=True" in text


@pytest.mark.redis
@pytest.mark.timeout(60)
def test_a_delayed_redis_retry_survives_the_app_stopping(redis_url: str, unique: str) -> None:
    """The app stops while a retry copy waits: the copy stays in Redis and is delivered
    after the next start (``check`` resumes the mover), with its attempt count."""
    import redis

    stream = f"fs-stop-{unique}"
    policy = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(1.0), local_retries=0)
    seen: list[int] = []

    def app() -> tuple[RedisBroker, MsgpatternsMiddleware]:
        middleware = MsgpatternsMiddleware(policy)
        broker = RedisBroker(redis_url, middlewares=[middleware])

        @broker.subscriber(stream=StreamSub(stream, group="billing", consumer="c1"))
        async def handle(body: dict[str, Any], delivery: Delivery) -> None:
            seen.append(delivery.attempt)
            if delivery.attempt == 1:
                raise TimeoutError("ledger busy")

        return broker, middleware

    async def first_run() -> None:
        broker, _ = app()
        async with broker:
            await broker.start()
            await broker.publish({"n": 1}, stream=stream)
            await until(lambda: seen == [1])
            await until(lambda: client.zcard(f"{stream}:fs-delayed") == 1)

    async def second_run() -> None:
        broker, middleware = app()
        async with broker:
            middleware.check(broker)
            await broker.start()
            await until(lambda: seen == [1, 2])

    client = redis.Redis.from_url(redis_url)
    try:
        asyncio.run(first_run())
        assert client.xpending(stream, "billing")["pending"] == 0  # acked: the copy is kept
        asyncio.run(second_run())
        assert client.zcard(f"{stream}:fs-delayed") == 0
        assert client.hlen(f"{stream}:fs-delayed:data") == 0
    finally:
        client.delete(stream, f"{stream}:fs-delayed", f"{stream}:fs-delayed:data")
        client.close()


@pytest.mark.nats
@pytest.mark.timeout(120)
def test_nats_forged_attempt_and_due_times_are_bounded_by_the_policy(unique: str) -> None:
    """The integration reads the library's headers through the adapters' functions
    (``headers.trusted_attempt``, ``honoured_due_at``; tests/test_wire_bounds.py): a
    forged ``attempt: 9000`` gets its retries, a due time six days out or ``inf`` is due
    now (``inf`` made ``nak(delay=inf)`` raise ``OverflowError`` before)."""
    import nats
    from faststream.nats import JStream, NatsBroker, PullSub

    from msgpatterns import headers as h
    from msgpatterns.brokers import NatsJetStreamBroker
    from msgpatterns.testing import services

    url = services.require("nats")
    subject = f"fs_bounds_{unique}"
    stream = JStream(NatsJetStreamBroker.stream_name(subject),
                     subjects=[subject, NatsJetStreamBroker.dead_letter_subject(subject)])
    policy = RetryPolicy(max_attempts=5, backoff=Backoff.fixed(0.05), local_retries=0,
                         max_delay=60)
    seen: dict[bytes, list[int]] = {}

    async def handle(body: bytes, delivery: Delivery) -> None:
        attempts = seen.setdefault(bytes(delivery.raw_body), [])
        attempts.append(delivery.attempt)
        if len(attempts) == 1:
            raise ConnectionError("transient")

    broker = NatsBroker(url, middlewares=[MsgpatternsMiddleware(policy)])
    broker.subscriber(subject, stream=stream, durable=f"g_{unique}",
                      pull_sub=PullSub(batch_size=1, timeout=0.2))(handle)
    items = [(b"attempt-9000", {h.ATTEMPT: "9000"}),
             (b"due-6d", {h.RETRY_DUE_AT: repr(time.time() + 6 * 86_400)}),
             (b"due-inf", {h.RETRY_DUE_AT: "inf"})]

    async def scenario() -> None:
        async with broker:
            await broker.start()
            nc = await nats.connect(url)  # a plain nats-py publisher
            try:
                for body, headers in items:
                    await nc.jetstream().publish(subject, body, headers=headers)
            finally:
                await nc.close()
            await until(lambda: all(len(seen.get(body, [])) >= 2 for body, _ in items))

    try:
        asyncio.run(scenario())
        assert seen[b"attempt-9000"] == [1, 2]
        assert all(len(seen[body]) == 2 for body, _ in items), seen
    finally:
        async def drop() -> None:
            nc = await nats.connect(url)
            try:
                await nc.jetstream().delete_stream(stream.name)
            finally:
                await nc.close()

        asyncio.run(drop())
