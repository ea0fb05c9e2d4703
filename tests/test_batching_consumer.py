"""The seed's flow end to end: a handler disables auto ack and hands each message to a
Flusher that writes batches and acks them; a failing batch is redelivered by the
consumer's retry policy and in the end every message is written once and acked.

Each test runs with the sync Flusher and with AsyncFlusher (its ``add`` awaited on an
event loop the consumer's workers hand it to, its processor an ``async def``), one
body behind batching_modes' face; the bulk insert goes through the sync Engine or an
AsyncEngine (psycopg 3 async, aiosqlite, aiomysql) to match."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from batching_modes import MODES, Batching, batching
from msgpatterns import Backoff, Consumer, InMemoryBroker, Message, RetryPolicy
from msgpatterns.testing import EffectLog, assert_all_acked
from ordering_db import SqlSide, engine_for, sql_side

GUARD = 60.0  # only bounds a hang if the code under test is broken
RETRY = RetryPolicy(backoff=Backoff.fixed(60.0))  # virtual time on the in-memory broker


@pytest.fixture(params=MODES)
def make(request: pytest.FixtureRequest) -> Iterator[Batching]:
    """``make(kind, processor, **options)`` on the sync API or the async one."""
    with batching(request.param) as modes:
        yield modes


@pytest.fixture
def db(make: Batching, sql_url: str) -> Iterator[SqlSide]:
    """The database through the API of ``make``'s mode."""
    with engine_for(sql_url) as engine, sql_side(make.mode, engine) as side:
        yield side


class FailOnce:
    """Makes the first batch through it fail; remembers that batch's keys."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.failed: list[str | None] = []

    def check(self, batch: list[Message]) -> None:
        with self.lock:
            if self.failed:
                return
            self.failed = [m.key for m in batch]
        raise ConnectionError("database connection lost mid-batch")


def consume_through(broker: InMemoryBroker, flusher: Any) -> Consumer:
    def handler(message: Message) -> None:
        message.disable_auto_ack()
        assert flusher.add(message, timeout=GUARD)

    consumer = Consumer(broker, handler, topics=["orders"], group="sink", workers=2, retry=RETRY)
    consumer.run_until_idle(timeout=GUARD)
    return consumer


def publish_orders(broker: InMemoryBroker, count: int) -> list[str]:
    keys = [f"order-{i}" for i in range(count)]
    for key in keys:
        broker.publish("orders", f"payload of {key}", key=key)
    return keys


def test_flusher_with_explicit_ack_redelivers_a_failed_batch_until_all_are_written(
    make: Batching, fake_broker: InMemoryBroker, effects: EffectLog
) -> None:
    keys = publish_orders(fake_broker, 200)
    fail_once = FailOnce()

    def write(batch: list[Message]) -> None:
        fail_once.check(batch)
        for message in batch:
            effects.record(message.key)

    with make("flusher", write, name="sink", batch_size=20, flush_interval=0.005,
              queue_size=200, threads=2, ack_messages=True) as flusher:
        consumer = consume_through(fake_broker, flusher)
    assert fail_once.failed, "the failing batch never happened"
    assert flusher.counters.errors == 1
    assert consumer.stats.redelivered == len(fail_once.failed)
    assert fake_broker.stats.redelivered == len(fail_once.failed)
    effects.assert_exactly_once(keys)
    assert_all_acked(fake_broker)


def test_bulk_insert_through_a_flusher_rolls_back_and_redelivers_a_failed_batch(
    make: Batching, db: SqlSide, fake_broker: InMemoryBroker, unique: str
) -> None:
    engine = db.engine
    table = sa.Table(
        f"batching_orders_{unique}",
        sa.MetaData(),
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("body", sa.Text, nullable=False),
    )
    table.create(engine)
    try:
        keys = publish_orders(fake_broker, 300)
        fail_once = FailOnce()

        def bulk_insert(batch: list[Message]) -> None:
            with db.begin() as conn:
                db.execute(conn, table.insert(), [{"id": m.key, "body": m.body} for m in batch])
                fail_once.check(batch)  # after the write: the transaction must roll back

        with make("flusher", bulk_insert, name="db-sink", batch_size=50, flush_interval=0.005,
                  queue_size=300, threads=2, ack_messages=True) as flusher:
            consume_through(fake_broker, flusher)
        with engine.connect() as conn:
            rows = conn.execute(sa.select(table.c.id)).scalars().all()
        assert sorted(rows) == sorted(keys)
        assert fail_once.failed
        assert flusher.counters.errors == 1
        assert_all_acked(fake_broker)
    finally:
        table.drop(engine)


@pytest.mark.parametrize("capacity", [1, 7])
def test_a_refused_add_fails_the_delivery_and_it_comes_back(
    make: Batching, fake_broker: InMemoryBroker, effects: EffectLog, capacity: int
) -> None:
    """The seed's ``if not flusher.add(message): message.ack(error)``: a refused message
    is redelivered later and written then; nothing is stranded waiting for an ack."""
    keys = publish_orders(fake_broker, 40)
    refused = threading.Event()

    def write(batch: list[Message]) -> None:
        assert refused.wait(GUARD)  # hold the queue full until some add was refused
        for message in batch:
            effects.record(message.key)

    def handler(message: Message) -> None:
        message.disable_auto_ack()
        if not flusher.add(message):
            refused.set()
            message.ack(RuntimeError("flusher full"))

    # Retries run on virtual time, i.e. at once in real time: on a loaded machine a slow
    # writer can refuse one message many times in a row. The point is that every refusal
    # comes back, so the attempts are not what is tested here.
    patient = RetryPolicy(max_attempts=100_000, backoff=Backoff.fixed(60.0))
    with make("flusher", write, name="tiny", batch_size=1, flush_interval=0.005,
              queue_size=capacity, threads=1, ack_messages=True) as flusher:
        consumer = Consumer(
            fake_broker, handler, topics=["orders"], group="sink", workers=2, retry=patient
        )
        consumer.run_until_idle(timeout=GUARD)
    effects.assert_exactly_once(keys)
    assert_all_acked(fake_broker)
    counters = flusher.counters
    assert counters.rejected >= 1
    assert (counters.items, counters.errors) == (40, 0)
    assert fake_broker.stats.redelivered == counters.rejected
