"""Bulk inserts from a message consumer: explicit ack + Flusher, end to end.

The handler takes over the ack (``message.disable_auto_ack()``) and hands each order
message to a :class:`~msgpatterns.Flusher`. The Flusher writes batches of up to 100
rows with one ``executemany`` (SQLAlchemy Core) and, with ``ack_messages=True``, acks
the batch's messages once the transaction commits. The first batch hits a simulated
connection loss after its INSERT: the transaction rolls back, the messages are acked
with the error, the consumer's retry policy redelivers them and they are written on
the next try. The broker also delivers some messages twice (at least once); the
primary key plus ``ON CONFLICT DO NOTHING`` makes those harmless.

    python examples/flusher_bulk_insert.py                # SQLite in a temporary file
    python examples/flusher_bulk_insert.py postgresql+psycopg://postgres@127.0.0.1/test
    DATABASE_URL=postgresql+psycopg://... python examples/flusher_bulk_insert.py
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import threading
import uuid
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite

from msgpatterns import Backoff, Consumer, Flusher, InMemoryBroker, Message, NeedRetry, RetryPolicy

ORDERS = 1_000


def orders_table(name: str) -> sa.Table:
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("order_id", sa.String(32), primary_key=True),
        sa.Column("customer", sa.String(64), nullable=False),
        sa.Column("amount_cents", sa.Integer, nullable=False),
    )


def insert_ignoring_duplicates(engine: sa.Engine, table: sa.Table) -> Any:
    """INSERT that skips rows whose primary key exists (a redelivered order).

    Without it one duplicate delivery would fail its whole batch again and again.
    """
    name = engine.dialect.name
    if name == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing(index_elements=["order_id"])
    if name == "sqlite":
        return sqlite.insert(table).on_conflict_do_nothing(index_elements=["order_id"])
    if name in ("mysql", "mariadb"):
        statement = mysql.insert(table)
        return statement.on_duplicate_key_update(order_id=statement.inserted.order_id)
    raise SystemExit(f"this example knows PostgreSQL, MySQL and SQLite, not {name}")


class FirstBatchFails:
    """A database that drops the connection once, after the first INSERT."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.failed = False

    def check(self) -> None:
        with self._lock:
            if self.failed:
                return
            self.failed = True
        raise ConnectionError("server closed the connection unexpectedly (simulated)")


def main(url: str) -> int:
    engine = sa.create_engine(url)
    table = orders_table(f"example_orders_{uuid.uuid4().hex[:8]}")
    table.create(engine)
    insert = insert_ignoring_duplicates(engine, table)
    database = FirstBatchFails()

    broker = InMemoryBroker(seed=7, duplicate_rate=0.05)
    for i in range(ORDERS):
        order_id = f"o-{i:05d}"
        order = {"order_id": order_id, "customer": f"c-{i % 37}", "amount_cents": i * 10}
        broker.publish("orders", json.dumps(order).encode(), key=order_id)

    def write_batch(batch: list[Message]) -> None:
        with engine.begin() as conn:  # one transaction per batch
            conn.execute(insert, [message.body for message in batch])
            database.check()  # raising here rolls the whole batch back

    try:
        with Flusher(
            "orders-writer", batch_size=100, flush_interval=0.05, queue_size=500,
            threads=2, processor=write_batch, ack_messages=True,
        ) as flusher:

            def handle(message: Message) -> None:
                message.disable_auto_ack()  # the Flusher acks once the batch commits
                if not flusher.add(message, timeout=5.0):
                    raise NeedRetry(delay=1.0, reason="writer queue full")

            consumer = Consumer(
                broker, handle, topics=["orders"], group="orders-db",
                workers=2, max_in_flight=500, decoder=json.loads,
                retry=RetryPolicy(backoff=Backoff.fixed(5.0)),
            )
            consumer.run_until_idle(timeout=120)  # in production: consumer.run()
        with engine.connect() as conn:
            written = conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one()
    finally:
        table.drop(engine)
        engine.dispose()

    counters = flusher.counters
    print(f"database:           {engine.url.render_as_string(hide_password=True)}")
    print(f"orders published:   {ORDERS}")
    print(f"deliveries:         {broker.stats.delivered} ({broker.stats.duplicates} duplicates)")
    print(f"rows written:       {written}")
    print(f"batches:            {counters.batches} ({counters.errors} failed and redelivered)")
    print(f"messages acked:     {consumer.stats.acked}, redelivered: {consumer.stats.redelivered}")
    print(f"pending / dead:     {broker.pending} / {len(broker.dead_letters)}")
    ok = (
        written == ORDERS and broker.pending == 0 and not broker.dead_letters
        and database.failed and counters.errors == 1
    )
    print("every order written exactly once and acked" if ok else "SOMETHING WENT WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    # One warning per redelivered message would drown the summary; the failed batch
    # itself is still logged (with its traceback) by the Flusher.
    logging.getLogger("msgpatterns.consumer").setLevel(logging.ERROR)
    given = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("DATABASE_URL")
    if given:
        sys.exit(main(given))
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(main(f"sqlite:///{os.path.join(tmp, 'orders.db')}"))
