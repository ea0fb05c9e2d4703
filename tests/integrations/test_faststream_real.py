"""FastStream integration against the real RabbitMQ and Redis: duplicates skipped,
retries on the schedule (attempt header increments, never early), dead letters that
the adapters (and so ``msgpatterns dlq``) read (issue 13, item 2)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

pytest.importorskip("faststream")

from faststream.rabbit import RabbitBroker, RabbitQueue, RabbitRouter
from faststream.redis import RedisBroker, RedisRouter, StreamSub

from msgpatterns import Backoff, MemoryChecker, Reject, RetryPolicy, idempotent
from msgpatterns.integrations.faststream import Delivery, MsgpatternsMiddleware

DELAY = 0.3
POLICY = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(DELAY), local_retries=0)


async def until(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    """Wait for ``condition`` (checked on every handler event, bounded)."""
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, "timed out"
        await asyncio.sleep(0.02)


class Scenario:
    """The handlers every broker runs: a flaky one (fails twice, then succeeds), a
    rejecting one, an idempotent sync one."""

    def __init__(self) -> None:
        self.flaky: list[tuple[int, float]] = []
        self.ran: list[str] = []
        self.duplicate = threading.Event()
        self.checker = MemoryChecker()

    async def flaky_handler(self, body: dict[str, Any], delivery: Delivery) -> None:
        self.flaky.append((delivery.attempt, time.monotonic()))
        if delivery.attempt < 3:
            raise TimeoutError("ledger busy")

    async def rejecting_handler(self, body: dict[str, Any]) -> None:
        raise Reject(f"unknown order {body['n']}")

    def idempotent_handler(self) -> Callable[..., Any]:
        @idempotent(self.checker, on_duplicate=lambda *a, **k: self.duplicate.set())
        def handle(body: dict[str, Any], delivery: Delivery) -> None:
            self.ran.append(str(body["n"]))
        return handle

    def check_schedule(self) -> None:
        attempts = [a for a, _ in self.flaky]
        assert attempts == [1, 2, 3]
        gaps = [b - a for (_, a), (_, b) in zip(self.flaky, self.flaky[1:], strict=False)]
        assert all(gap >= DELAY for gap in gaps), gaps  # never early


async def publish_all(publish: Callable[..., Awaitable[Any]], s: Scenario) -> None:
    await publish("flaky", {"n": 1}, "flaky-1")
    await publish("reject", {"n": 2}, "reject-1")
    await publish("dedup", {"n": 3}, "order-3")
    await publish("dedup", {"n": 3}, "order-3")
    await until(lambda: len(s.flaky) == 3 and s.duplicate.is_set())


@pytest.mark.rabbitmq
@pytest.mark.timeout(60)
def test_rabbitmq(rabbitmq_url: str, unique: str) -> None:
    from msgpatterns.brokers import RabbitMQBroker

    topic = f"fs-{unique}"
    names = {kind: f"{topic}-{kind}.billing" for kind in ("flaky", "reject", "dedup")}
    s = Scenario()
    broker = RabbitBroker(rabbitmq_url)
    router = RabbitRouter(middlewares=[MsgpatternsMiddleware(POLICY)])
    router.subscriber(RabbitQueue(names["flaky"], auto_delete=True))(s.flaky_handler)
    router.subscriber(RabbitQueue(names["reject"], auto_delete=True))(s.rejecting_handler)
    router.subscriber(RabbitQueue(names["dedup"], auto_delete=True))(s.idempotent_handler())
    broker.include_router(router)

    async def scenario() -> None:
        async with broker:
            await broker.start()

            async def publish(kind: str, body: Any, message_id: str) -> None:
                await broker.publish(body, queue=names[kind], message_id=message_id)

            await publish_all(publish, s)
            await until(lambda: len(adapter.list_dead_letters(f"{topic}-reject",
                                                              "billing")) == 1)

    adapter = RabbitMQBroker(rabbitmq_url, declare=False)
    try:
        asyncio.run(scenario())
        s.check_schedule()
        assert s.ran == ["3"]
        [record] = adapter.list_dead_letters(f"{topic}-reject", "billing")
        assert record.message.id == "reject-1"
        assert record.reason == "rejected: unknown order 2"
        assert record.message.raw_body == b'{"n":2}'
        adapter.purge_dead_letters(f"{topic}-reject", "billing")
    finally:
        adapter.close()
        _delete_queue(rabbitmq_url, RabbitMQBroker.dead_letter_queue_name(names["reject"]))


def _delete_queue(url: str, name: str) -> None:
    import pika

    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        conn.channel().queue_delete(name)
    finally:
        conn.close()


@pytest.mark.redis
@pytest.mark.timeout(60)
def test_redis_streams(redis_url: str, unique: str) -> None:
    import redis

    from msgpatterns.brokers import RedisStreamsBroker

    streams = {kind: f"fs-{unique}-{kind}" for kind in ("flaky", "reject", "dedup")}
    s = Scenario()
    broker = RedisBroker(redis_url)
    router = RedisRouter(middlewares=[MsgpatternsMiddleware(POLICY)])

    def sub(kind: str) -> StreamSub:
        return StreamSub(streams[kind], group="billing", consumer="c1")

    router.subscriber(stream=sub("flaky"))(s.flaky_handler)
    router.subscriber(stream=sub("reject"))(s.rejecting_handler)
    router.subscriber(stream=sub("dedup"))(s.idempotent_handler())
    broker.include_router(router)
    adapter = RedisStreamsBroker(redis_url)

    async def scenario() -> None:
        async with broker:
            await broker.start()

            async def publish(kind: str, body: Any, message_id: str) -> None:
                await broker.publish(body, stream=streams[kind],
                                     headers={"message_id": message_id})

            await publish_all(publish, s)
            await until(lambda: len(adapter.list_dead_letters(streams["reject"])) == 1)

    client = redis.Redis.from_url(redis_url)
    try:
        asyncio.run(scenario())
        s.check_schedule()
        assert s.ran == ["3"]
        [record] = adapter.list_dead_letters(streams["reject"], "billing")
        assert record.message.id == "reject-1"
        assert record.reason == "rejected: unknown order 2"
        assert record.group == "billing"
    finally:
        adapter.close()
        client.delete(*streams.values(), *(f"{name}:dlq" for name in streams.values()))
        client.close()
