"""The async side of the one lifecycle, from the outside: every async resource - the
async checkers (a real Redis, aiosqlite / PostgreSQL / MariaDB, transactional), the
async brokers (the fake, Redis Streams, RabbitMQ, Kafka on both adapters: the
conformance harnesses), the async batching queues, the async dead-letter admin - has
``aclose()`` and ``async with``; a second ``aclose()`` does nothing; afterwards every
operation raises its ``ClosedError`` (``CheckerClosed``, ``BrokerClosed``,
``QueueClosed``) at once.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from async_db import async_url
from test_conformance_async import HARNESSES, AsyncHarness

from msgpatterns import Message, idempotent
from msgpatterns.aio import (
    AsyncBatchExecutor,
    AsyncDeadLetters,
    AsyncFlusher,
    AsyncInMemoryBroker,
    AsyncMultipleQueueFlusher,
)
from msgpatterns.errors import BrokerClosed, CheckerClosed, ClosedError, QueueClosed
from msgpatterns.idempotency import (
    AsyncRedisChecker,
    AsyncSqlChecker,
    AsyncTransactionalSqlChecker,
    MemoryChecker,
)
from msgpatterns.testing import services

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

CHECKERS = [
    "memory",
    pytest.param("redis", marks=pytest.mark.redis),
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("mysql", marks=pytest.mark.mysql),
    pytest.param("tx-sqlite", id="tx-sqlite"),
    pytest.param("tx-postgres", marks=pytest.mark.postgres),
]


def _sql_url(kind: str, tmp_path: Path) -> str:
    if kind == "sqlite":
        return async_url(f"sqlite:///{tmp_path / 'dedup.db'}")
    return async_url(services.require(kind))


@pytest.fixture(params=CHECKERS)
async def checker(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    kind: str = request.param
    table = f"dedup_{uuid.uuid4().hex[:10]}"
    made: Any
    if kind == "memory":
        made = MemoryChecker()
    elif kind == "redis":
        made = AsyncRedisChecker(services.require("redis"), namespace=f"test-{table}")
    elif kind.startswith("tx-"):
        made = AsyncTransactionalSqlChecker(_sql_url(kind[3:], tmp_path), table)
    else:
        made = AsyncSqlChecker(_sql_url(kind, tmp_path), table)
    yield made
    if kind not in ("memory", "redis", "sqlite", "tx-sqlite"):
        from sqlalchemy import create_engine

        from msgpatterns.idempotency.sql_table import DedupTable

        url = services.require(kind.removeprefix("tx-"))
        engine = create_engine(url)
        try:
            DedupTable(engine, table).drop()
        finally:
            engine.dispose()
    elif kind == "redis":
        import redis

        client = redis.Redis.from_url(services.require("redis"))
        keys = list(client.scan_iter(match=f"test-{table}:*"))
        if keys:
            client.delete(*keys)
        client.close()


async def test_an_async_checker_is_an_async_context_manager_closed_once(checker: Any) -> None:
    if checker.passes_tx:
        @idempotent(checker)
        async def handle(message: Message, tx: Any) -> str:
            return "ran"
    else:
        @idempotent(checker)
        async def handle(message: Message) -> str:
            return "ran"

    async with checker as same:
        assert same is checker
        assert await handle(Message(b"x", id="m-1")) == "ran"
    assert checker.closed
    await checker.aclose()  # idempotent
    with pytest.raises(CheckerClosed, match="closed") as refused:
        await handle(Message(b"x", id="m-2"))
    assert isinstance(refused.value, ClosedError)


# -- the async brokers, on the conformance harnesses ----------------------------------------


@pytest.fixture(params=[pytest.param("memory", id="memory"),
                        pytest.param("redis", id="redis", marks=pytest.mark.redis),
                        pytest.param("rabbitmq", id="rabbitmq", marks=pytest.mark.rabbitmq),
                        pytest.param("kafka", id="kafka", marks=pytest.mark.kafka),
                        pytest.param("kafka-aiokafka", id="kafka-aiokafka",
                                     marks=pytest.mark.kafka)])
async def h(request: pytest.FixtureRequest) -> AsyncIterator[AsyncHarness]:
    harness = HARNESSES[request.param]()
    try:
        yield harness
    finally:
        await harness.cleanup()


async def test_an_async_broker_closes_once_and_refuses_everything_afterwards(
        h: AsyncHarness) -> None:
    broker = await h.broker()
    async with broker as same:
        assert same is broker
        await broker.publish(h.topic, b"before the close")
    assert broker.closed
    await broker.aclose()  # a second close (under either name) does nothing
    await broker.close()
    for operation in (lambda: broker.publish(h.topic, b"after"),
                      lambda: broker.fetch([h.topic], h.group, 1, 0.0)):
        with pytest.raises(BrokerClosed) as refused:
            await operation()
        assert isinstance(refused.value, ClosedError)


async def test_the_async_dead_letter_admin_closes_under_both_names() -> None:
    broker = AsyncInMemoryBroker()
    async with AsyncDeadLetters(broker.dead_letter_admin()) as admin:
        assert await admin.list_dead_letters("t") == []
    await admin.aclose()
    await admin.close()
    await broker.aclose()


# -- the async batching queues -----------------------------------------------------------


def _queues() -> list[Any]:
    async def write(batch: Any) -> None:
        pass

    return [AsyncBatchExecutor("life", 10, write),
            AsyncFlusher("life", 10, 0.05, 100, write),
            AsyncMultipleQueueFlusher("life", 2, 100, 10, 0.05, lambda item: 0, write)]


async def test_async_batching_queues_close_once_and_refuse_adds() -> None:
    for queue in _queues():
        async with queue as same:
            assert same is queue
            assert await queue.add(1)
        assert await queue.aclose() in (True, False)  # idempotent
        with pytest.raises(QueueClosed) as refused:
            await queue.add(2)
        assert isinstance(refused.value, ClosedError)
