"""AsyncTransactionalSqlChecker (issue 12 item 3): the dedup row and an ``async def``
handler's writes commit together, on aiosqlite and the real PostgreSQL (psycopg 3
async) and MariaDB (aiomysql); including the crash test: the process (or the task) dies
between the handler's writes and the commit - nothing is applied, and the redelivery
runs once.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from async_db import async_url
from sqlalchemy.ext.asyncio import AsyncConnection

from msgpatterns import Message, RetryPolicy
from msgpatterns.aio import AsyncConsumer, AsyncInMemoryBroker
from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency import AsyncTransactionalSqlChecker, idempotent
from msgpatterns.retry import Backoff
from msgpatterns.testing import services

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

DATABASES = [
    "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("mysql", marks=pytest.mark.mysql),
]


@dataclass
class Db:
    url: str
    engine: sa.Engine
    checker: AsyncTransactionalSqlChecker
    payments: sa.Table
    dedup: str

    def paid(self) -> list[str]:
        with self.engine.connect() as conn:
            return sorted(conn.scalars(sa.select(self.payments.c.order_id)))

    def dedup_rows(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(sa.text(f"SELECT COUNT(*) FROM {self.dedup}")).scalar_one())


@pytest.fixture(params=DATABASES)
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Db]:
    url = (f"sqlite:///{tmp_path / 'shop.db'}" if request.param == "sqlite"
           else services.require(request.param))
    suffix = uuid.uuid4().hex[:10]
    engine = sa.create_engine(url)
    payments = sa.Table(f"payments_{suffix}", sa.MetaData(),
                        sa.Column("order_id", sa.String(50), primary_key=True))
    payments.create(engine)
    dedup = f"dedup_{suffix}"
    checker = AsyncTransactionalSqlChecker(async_url(url), dedup)
    try:
        yield Db(url, engine, checker, payments, dedup)
    finally:
        await checker.aclose()
        payments.drop(engine)
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {dedup}"))
        engine.dispose()


def pay(db: Db) -> Any:
    @idempotent(db.checker, group="payments")
    async def handle(message: Message, tx: AsyncConnection) -> str:
        await tx.execute(db.payments.insert().values(order_id=message.key))
        return "paid"

    return handle


async def test_the_writes_and_the_dedup_row_commit_together(db: Db) -> None:
    handle = pay(db)
    assert await handle(Message({}, key="o-1")) == "paid"
    assert await handle(Message({}, key="o-1")) is None  # a duplicate: skipped
    assert db.paid() == ["o-1"] and db.dedup_rows() == 1


async def test_a_failing_handler_rolls_back_both_and_the_retry_applies_once(db: Db) -> None:
    attempts: list[str] = []

    @idempotent(db.checker, group="payments")
    async def handle(message: Message, tx: AsyncConnection) -> None:
        await tx.execute(db.payments.insert().values(order_id=message.key))
        attempts.append(str(message.key))
        if len(attempts) == 1:
            raise RuntimeError("failed after the write")

    with pytest.raises(RuntimeError):
        await handle(Message({}, key="o-1"))
    assert db.paid() == [] and db.dedup_rows() == 0
    await handle(Message({}, key="o-1"))
    await handle(Message({}, key="o-1"))
    assert db.paid() == ["o-1"] and attempts == ["o-1", "o-1"]


async def test_a_task_cancelled_between_write_and_commit_applies_nothing(db: Db) -> None:
    written = asyncio.Event()

    @idempotent(db.checker, group="payments")
    async def stuck(message: Message, tx: AsyncConnection) -> None:
        await tx.execute(db.payments.insert().values(order_id=message.key))
        written.set()
        await asyncio.Event().wait()  # the task dies here, before the commit

    task = asyncio.create_task(stuck(Message({}, key="o-1")))
    await written.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert db.paid() == [] and db.dedup_rows() == 0
    handle = pay(db)  # the redelivery
    assert await handle(Message({}, key="o-1")) == "paid"
    assert await handle(Message({}, key="o-1")) is None
    assert db.paid() == ["o-1"]


CRASH = textwrap.dedent("""
    import asyncio, os, sys
    import sqlalchemy as sa
    from msgpatterns import Message
    from msgpatterns.idempotency import AsyncTransactionalSqlChecker, idempotent

    url, dedup, table = sys.argv[1:4]
    payments = sa.Table(table, sa.MetaData(), sa.Column("order_id", sa.String(50),
                                                        primary_key=True))
    checker = AsyncTransactionalSqlChecker(url, dedup)

    @idempotent(checker, group="payments")
    async def handle(message, tx):
        await tx.execute(payments.insert().values(order_id=message.key))
        os._exit(17)  # the process dies between the business write and the commit

    asyncio.run(handle(Message({}, key="o-1")))
""")


async def test_a_process_killed_between_write_and_commit_applies_it_exactly_once(
        db: Db) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    crashed = subprocess.run(
        [sys.executable, "-c", CRASH, async_url(db.url), db.dedup, db.payments.name],
        env=env, capture_output=True, text=True, timeout=60, check=False)
    assert crashed.returncode == 17, crashed.stderr
    assert db.paid() == [] and db.dedup_rows() == 0  # neither the write nor the key
    handle = pay(db)  # the redelivery, after the crash
    assert await handle(Message({}, key="o-1")) == "paid"
    assert await handle(Message({}, key="o-1")) is None  # and any later duplicate
    assert db.paid() == ["o-1"] and db.dedup_rows() == 1


async def test_exactly_once_through_the_async_consumer(db: Db) -> None:
    broker = AsyncInMemoryBroker()
    keys = [f"o-{i}" for i in range(8)]
    for key in keys + keys[:4]:
        await broker.publish("orders", {}, key=key)
    consumer = AsyncConsumer(broker, pay(db), topics=["orders"], group="billing",
                             max_in_flight=1 if db.url.startswith("sqlite") else 4,
                             retry=RetryPolicy(max_attempts=5, backoff=Backoff.fixed(0),
                                               local_retries=0))
    await consumer.run_until_idle()
    assert db.paid() == sorted(keys)
    assert consumer.stats.acked == 12


async def test_stored_results_are_committed_with_the_effect(db: Db) -> None:
    @idempotent(db.checker, group="payments", store_result=True)
    async def handle(message: Message, tx: AsyncConnection) -> dict[str, str]:
        await tx.execute(db.payments.insert().values(order_id=message.key))
        return {"receipt": f"r-{message.key}"}

    assert await handle(Message({}, key="o-1")) == {"receipt": "r-o-1"}
    assert await handle(Message({}, key="o-1")) == {"receipt": "r-o-1"}
    assert db.paid() == ["o-1"]


def test_fail_open_and_a_missing_tx_are_refused(tmp_path: Path) -> None:
    checker = AsyncTransactionalSqlChecker(f"sqlite+aiosqlite:///{tmp_path / 'x.db'}")

    async def no_tx(message: Message) -> None: ...

    with pytest.raises(ConfigurationError, match="tx"):
        idempotent(checker)(no_tx)

    @idempotent(checker, fail_open=True)
    async def handle(message: Message, tx: AsyncConnection) -> None: ...

    with pytest.raises(ConfigurationError, match="fail_open"):
        asyncio.run(handle(Message({}, id="m")))
