"""FastStream integration on FastStream's own TestBroker (in memory): duplicates
skipped, retries on the schedule with the attempt header, dead letters for Reject and
after max_attempts (issue 13, item 2)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("faststream")

from faststream.rabbit import RabbitBroker, RabbitMessage, RabbitRouter, TestRabbitBroker
from faststream.redis import RedisBroker, StreamSub, TestRedisBroker

from msgpatterns import Backoff, MemoryChecker, NeedRetry, Reject, RetryPolicy, idempotent
from msgpatterns import headers as h
from msgpatterns.brokers import codec
from msgpatterns.deadletter import MemoryDeadLetterStore
from msgpatterns.integrations.faststream import Delivery, MsgpatternsMiddleware

POLICY = RetryPolicy(max_attempts=3, backoff=Backoff.levels([0.25, 0.5]), local_retries=0)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def rabbit(policy: RetryPolicy = POLICY) -> tuple[RabbitBroker, RabbitRouter]:
    """A broker, and a router whose subscribers get the middleware (the broker's own
    subscribers below stand for the retry and dead-letter queues' readers)."""
    broker = RabbitBroker()
    return broker, RabbitRouter(middlewares=[MsgpatternsMiddleware(policy)])


async def publish_twice(broker: RabbitBroker, router: RabbitRouter) -> None:
    """Publish order-1 twice (a duplicate) to the router's "orders" subscriber."""
    broker.include_router(router)
    async with TestRabbitBroker(broker) as test:
        await test.publish({"n": 1}, queue="orders", message_id="order-1")
        await test.publish({"n": 1}, queue="orders", message_id="order-1")


def test_duplicates_are_skipped_by_idempotent_on_a_sync_handler() -> None:
    broker, router = rabbit()
    ran: list[dict[str, Any]] = []

    @router.subscriber("orders")
    @idempotent(MemoryChecker())
    def handle(body: dict[str, Any], delivery: Delivery) -> None:
        assert delivery.id == "order-1" and delivery.attempt == 1
        ran.append(body)

    run(publish_twice(broker, router))
    assert ran == [{"n": 1}]


def test_an_async_idempotent_handler_runs_once_and_a_failed_body_is_retried() -> None:
    """@idempotent on an async def handler (an async checker): a duplicate is skipped,
    and a body that fails is redelivered by the middleware and runs again (the key was
    released, never marked DONE before the body ran)."""
    broker, router = rabbit(RetryPolicy(max_attempts=3, backoff=Backoff.levels([0.0]),
                                        local_retries=1))
    ran: list[dict[str, Any]] = []
    failures: list[int] = []

    @router.subscriber("orders")
    @idempotent(MemoryChecker())
    async def handle(body: dict[str, Any], delivery: Delivery) -> None:
        await asyncio.sleep(0)
        if not failures:
            failures.append(delivery.attempt)
            raise RuntimeError("the body failed")
        ran.append(body)

    run(publish_twice(broker, router))
    assert failures == [1] and ran == [{"n": 1}]


def test_a_failure_is_republished_to_the_ttl_queue_with_the_next_attempt() -> None:
    broker, router = rabbit()
    copies: list[RabbitMessage] = []

    @router.subscriber("orders")
    async def handle(body: dict[str, Any]) -> None:
        raise TimeoutError("ledger down")

    @broker.subscriber("orders.retry.250")  # stands for the TTL queue's content
    async def parked(body: dict[str, Any], msg: RabbitMessage) -> None:
        copies.append(msg)

    async def scenario() -> None:
        broker.include_router(router)
        async with TestRabbitBroker(broker) as test:
            await test.publish({"n": 1}, queue="orders", message_id="order-1",
                               headers={"trace": "t1"})

    run(scenario())
    [copy] = copies
    assert copy.message_id == "order-1"
    assert copy.headers[h.ATTEMPT] == "2"
    assert copy.headers[h.ERROR_TYPE] == "TimeoutError"
    assert copy.headers["trace"] == "t1"


def test_need_retry_without_delay_is_retried_in_process() -> None:
    policy = RetryPolicy(max_attempts=3, local_retries=2, local_backoff=Backoff.fixed(0))
    broker, router = rabbit(policy)
    calls: list[int] = []

    @router.subscriber("orders")
    async def handle(body: dict[str, Any], delivery: Delivery) -> None:
        calls.append(delivery.local_retries)
        if len(calls) < 3:
            raise NeedRetry()

    async def scenario() -> None:
        broker.include_router(router)
        async with TestRabbitBroker(broker) as test:
            await test.publish({"n": 1}, queue="orders", message_id="order-1")

    run(scenario())
    assert calls == [0, 1, 2]


@pytest.mark.parametrize(("attempt", "error", "reason"), [
    ("1", Reject("unknown order"), "unknown order"),
    ("3", ValueError("still broken"), "gave up after 3 attempts"),
])
def test_dead_letters_carry_the_full_record(attempt: str, error: Exception,
                                            reason: str) -> None:
    broker, router = rabbit()
    parked: list[RabbitMessage] = []

    @router.subscriber("orders")
    async def handle(body: dict[str, Any]) -> None:
        raise error

    @broker.subscriber("orders.dlq")
    async def dead(body: Any, msg: RabbitMessage) -> None:
        parked.append(msg)

    async def scenario() -> None:
        broker.include_router(router)
        async with TestRabbitBroker(broker) as test:
            await test.publish({"n": 1}, queue="orders", message_id="order-1",
                               headers={h.ATTEMPT: attempt})

    run(scenario())
    [msg] = parked
    record = codec.read_dead_letter(msg.body, msg.headers, fallback_id=msg.message_id)
    assert record.message.id == "order-1"
    assert record.attempts == int(attempt)
    assert record.error_type.endswith(type(error).__name__)
    assert reason in record.reason
    assert record.message.raw_body == b'{"n":1}'


def test_redis_stream_retry_copy_and_dead_letter_store() -> None:
    store = MemoryDeadLetterStore()
    broker = RedisBroker(middlewares=[MsgpatternsMiddleware(POLICY, dead_letters=store)])
    seen: list[tuple[int, str | None]] = []

    @broker.subscriber(stream=StreamSub("orders", group="billing", consumer="c1"))
    async def handle(body: dict[str, Any], delivery: Delivery) -> None:
        seen.append((delivery.attempt, delivery.id))
        raise ValueError("nope")

    async def scenario() -> None:
        async with TestRedisBroker(broker) as test:
            await test.publish({"n": 1}, stream="orders",
                               headers={"message_id": "order-1"})

    run(scenario())
    # TestRedisBroker delivers the re-added copies at once: 3 attempts, then the DLQ
    assert seen == [(1, "order-1"), (2, "order-1"), (3, "order-1")]
    [record] = store.records
    assert record.attempts == 3 and record.group == "billing"
    assert record.error_type == "builtins.ValueError"
