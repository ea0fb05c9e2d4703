"""Exactly-once payments from an at-least-once broker, in five minutes.

The in-memory broker misbehaves like a real one under stress: it delivers a third of
the messages twice, loses a tenth of the acks (so acked messages come back later) and
reorders deliveries. The handler charges each order once, whatever the broker does:

* ``@idempotent(checker)`` skips a message whose key (``message.key``) is already done,
  and acks it; a copy that arrives while the first is still running is retried later.
* With ``TransactionalSqlChecker`` (the default here) the dedup row and the payment
  row commit in the same transaction, written through ``tx``: even a crash between
  the two cannot charge twice.

    python examples/idempotent_handler.py                     # SQLite in a temporary dir
    python examples/idempotent_handler.py --checker redis     # fakeredis (or --redis-url)
    python examples/idempotent_handler.py --checker sql       # SqlChecker, leases
    python examples/idempotent_handler.py --db postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import uuid
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from msgpatterns import (
    Consumer,
    InMemoryBroker,
    Message,
    RedisChecker,
    SqlChecker,
    TransactionalSqlChecker,
    idempotent,
)
from msgpatterns.idempotency import Checker

ORDERS = 300


def payments_table(name: str) -> sa.Table:
    return sa.Table(
        name, sa.MetaData(),
        sa.Column("order_id", sa.String(40), primary_key=True),
        sa.Column("amount", sa.Integer, nullable=False),
    )


def build_checker(kind: str, db: str, redis_url: str | None, table: str) -> Checker:
    if kind == "transactional":
        return TransactionalSqlChecker(db, table=table)
    if kind == "sql":
        return SqlChecker(db, table=table)
    if redis_url:
        return RedisChecker(redis_url, namespace=f"example-{uuid.uuid4().hex[:8]}")
    import fakeredis

    return RedisChecker(fakeredis.FakeRedis(), namespace="example")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checker", choices=["transactional", "sql", "redis"],
                        default="transactional")
    parser.add_argument("--db", help="SQLAlchemy URL (default: SQLite in a temporary dir)")
    parser.add_argument("--redis-url", help="a real Redis for --checker redis")
    args = parser.parse_args()

    workdir = tempfile.TemporaryDirectory()
    db = args.db or f"sqlite:///{Path(workdir.name) / 'payments.db'}"
    engine = sa.create_engine(db)
    suffix = uuid.uuid4().hex[:8]
    payments = payments_table(f"payments_{suffix}")
    payments.create(engine)
    checker = build_checker(args.checker, db, args.redis_url, f"dedup_{suffix}")

    # 1. The broker: duplicates, lost acks, reordering.
    broker = InMemoryBroker(seed=42, duplicate_rate=0.3, lost_ack_rate=0.1, reorder_window=8)
    for i in range(ORDERS):
        broker.publish("payments", json.dumps({"amount": i % 50 + 1}), key=f"order-{i}")
    expected_total = sum(i % 50 + 1 for i in range(ORDERS))

    # 2. The handler: charge the order. The decorator makes it idempotent by key.
    calls = 0
    lock = threading.Lock()

    def charge(message: Message, tx: sa.Connection) -> None:
        nonlocal calls
        with lock:
            calls += 1
        tx.execute(payments.insert().values(
            order_id=message.key, amount=json.loads(message.body)["amount"]))

    if isinstance(checker, TransactionalSqlChecker):
        @idempotent(checker)
        def handle(message: Message, tx: sa.Connection) -> None:
            charge(message, tx)  # the payment commits with the dedup row
    else:
        @idempotent(checker)
        def handle(message: Message, tx: Any = None) -> None:
            with engine.begin() as conn:  # its own transaction; dedup is separate
                charge(message, conn)

    # 3. Consume until nothing is left (retries run on the broker's virtual clock).
    consumer = Consumer(broker, handle, topics=["payments"], group="billing", workers=4)
    consumer.run_until_idle(timeout=120)
    checker.close()

    with engine.connect() as conn:
        rows = conn.execute(sa.select(sa.func.count(), sa.func.sum(payments.c.amount))).one()
    payments.drop(engine)
    engine.dispose()
    workdir.cleanup()

    stats = checker.stats
    print(f"checker:                 {type(checker).__name__}")
    print(f"orders published:        {ORDERS}")
    print(f"deliveries:              {broker.stats.delivered} "
          f"({broker.stats.duplicates} duplicated, {broker.stats.lost_acks} acks lost)")
    print(f"handler bodies run:      {calls}")
    print(f"duplicates skipped:      {stats.duplicates} (acked, never an error)")
    print(f"payments written:        {rows[0]}, total {rows[1]} (expected {ORDERS}, "
          f"{expected_total})")
    exact = rows[0] == ORDERS and rows[1] == expected_total and broker.pending == 0 \
        and not broker.dead_letters
    print("result:                  " + ("every order charged exactly once" if exact
                                         else "WRONG: see the counts above"))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
