"""Exactly-once payments from ``async def`` handlers: @idempotent on asyncio.

An ``AsyncConsumer`` reads orders from a broker that delivers some of them twice; the
handler is an ``async def`` guarded by ``@idempotent`` with
``AsyncTransactionalSqlChecker``: the dedup row and the payment row commit in one
transaction, written through ``tx`` (an ``AsyncConnection``), so even a crash between
the two cannot charge twice. (``AsyncRedisChecker`` and ``AsyncSqlChecker`` guard
handlers whose effects live elsewhere, with leases.)

The first attempt of every fifth order fails after its write: everything rolls back,
and the retry charges it once.

    python examples/async_idempotent.py                        # aiosqlite, a temp dir
    python examples/async_idempotent.py --db postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import uuid
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from msgpatterns import Message, RetryPolicy
from msgpatterns.aio import AsyncConsumer, AsyncInMemoryBroker
from msgpatterns.idempotency import AsyncTransactionalSqlChecker, idempotent
from msgpatterns.retry import Backoff

ORDERS = 50


async def main(db: str) -> None:
    suffix = uuid.uuid4().hex[:8]
    payments = sa.Table(f"payments_{suffix}", sa.MetaData(),
                        sa.Column("order_id", sa.String(40), primary_key=True),
                        sa.Column("amount", sa.Integer, nullable=False))
    engine = create_async_engine(db)
    async with engine.begin() as conn:
        await conn.run_sync(payments.create)
    failed: set[str] = set()
    checker = AsyncTransactionalSqlChecker(engine, f"dedup_{suffix}")

    @idempotent(checker, group="payments")
    async def handle(message: Message, tx: AsyncConnection) -> None:
        await tx.execute(payments.insert().values(order_id=message.key,
                                                  amount=message.body["amount"]))
        key = str(message.key)
        if int(key.split("-")[1]) % 5 == 0 and key not in failed:
            failed.add(key)  # after the write: rolled back with the dedup row
            raise RuntimeError(f"{key}: the payment provider timed out")

    broker = AsyncInMemoryBroker()
    keys = [f"order-{i}" for i in range(ORDERS)]
    for key in keys + keys[::3]:  # every third order delivered twice
        await broker.publish("orders", {"amount": 10}, key=key)
    consumer = AsyncConsumer(broker, handle, topics=["orders"], group="billing",
                             max_in_flight=1 if db.startswith("sqlite") else 20,
                             retry=RetryPolicy(max_attempts=5, backoff=Backoff.fixed(0),
                                               local_retries=0))
    stats = await consumer.run_until_idle(timeout=120)
    async with engine.connect() as conn:
        rows = (await conn.execute(sa.select(sa.func.count()).select_from(payments))).scalar()
        await conn.run_sync(payments.drop)
    await checker.aclose()
    await engine.dispose()
    print(f"deliveries acked: {stats.acked}, failed attempts retried: {stats.failed}")
    print(f"payments: {rows} rows for {ORDERS} orders (duplicates skipped: "
          f"{checker.stats.duplicates}, rolled back: {checker.stats.released})")
    assert rows == ORDERS, "an order was charged twice or not at all"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", default=None, help="an async SQLAlchemy URL")
    args = parser.parse_args()
    logging.getLogger("msgpatterns").setLevel(logging.ERROR)  # the failures are planned
    with tempfile.TemporaryDirectory() as tmp:
        url = args.db or f"sqlite+aiosqlite:///{Path(tmp) / 'shop.db'}"
        asyncio.run(main(url))
