"""TransactionalSqlChecker: the dedup row and the handler's writes commit together.

On SQLite always, and on the real PostgreSQL and MariaDB with the markers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
import tenacity
from sqlalchemy.engine import Connection

from msgpatterns import Consumer, InMemoryBroker, Message, RetryPolicy
from msgpatterns.errors import ConfigurationError, InProgress, NeedRetry
from msgpatterns.idempotency import (
    SqlChecker,
    Status,
    TransactionalSqlChecker,
    idempotent,
)
from msgpatterns.retry import Backoff
from msgpatterns.testing import assert_all_acked
from msgpatterns.testing.checker_fixtures import SQL_STORES, checker_for, store_params

SQL = store_params(*SQL_STORES)


@dataclass
class Db:
    checker: TransactionalSqlChecker
    payments: sa.Table
    kind: str

    def paid(self) -> list[str]:
        with self.checker.engine.connect() as conn:
            return list(conn.scalars(sa.select(self.payments.c.order_id)))

    def dedup_rows(self) -> int:
        with self.checker.engine.connect() as conn:
            table = self.checker.store.table.table
            return int(conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


@pytest.fixture(params=SQL)
def db(request: pytest.FixtureRequest, tmp_path: Path, unique: str) -> Iterator[Db]:
    with checker_for(request.param, tmp_path, transactional=True) as checker:
        assert isinstance(checker, TransactionalSqlChecker)
        payments = sa.Table(
            f"payments_{unique}", sa.MetaData(),
            sa.Column("order_id", sa.String(50), primary_key=True),
            sa.Column("amount", sa.Integer, nullable=False),
        )
        payments.create(checker.engine)
        checker.create_table()
        try:
            yield Db(checker, payments, request.param)
        finally:
            payments.drop(checker.engine)


def pay(db: Db) -> Callable[..., str | None]:
    @idempotent(db.checker, group="payments")
    def handle(message: Message, tx: Connection) -> str:
        tx.execute(db.payments.insert().values(order_id=message.key, amount=message.body))
        return "paid"

    return handle


def test_the_handler_writes_through_tx_and_both_commit_together(db: Db) -> None:
    handle = pay(db)
    assert handle(Message(10, key="o-1")) == "paid"
    assert db.paid() == ["o-1"]
    assert db.dedup_rows() == 1
    assert handle(Message(10, key="o-1")) is None
    assert db.paid() == ["o-1"]
    assert db.checker.stats.duplicates == 1 and db.checker.stats.completed == 1


def test_a_handler_error_rolls_back_the_writes_and_the_dedup_row(db: Db) -> None:
    @idempotent(db.checker, group="payments")
    def handle(message: Message, tx: Connection) -> None:
        tx.execute(db.payments.insert().values(order_id=message.key, amount=message.body))
        raise RuntimeError("card declined")

    with pytest.raises(RuntimeError, match="card declined"):
        handle(Message(10, key="o-1"))
    assert db.paid() == [] and db.dedup_rows() == 0
    assert pay(db)(Message(10, key="o-1")) == "paid"
    assert db.paid() == ["o-1"]


def test_exactly_once_through_the_consumer_with_duplicates_and_lost_acks(db: Db) -> None:
    broker = InMemoryBroker(seed=3, duplicate_rate=0.3, lost_ack_rate=0.2, reorder_window=3)
    keys = [f"o-{i}" for i in range(40)]
    for i, key in enumerate(keys):
        broker.publish("payments", i, key=key)
    consumer = Consumer(broker, pay(db), topics=["payments"], group="billing",
                        workers=2, retry=RetryPolicy(backoff=Backoff.fixed(1.0)))
    consumer.run_until_idle(timeout=60)
    assert sorted(db.paid()) == sorted(keys)
    assert_all_acked(broker)
    assert broker.stats.duplicates > 0


def _waiting_inserts(db: Db) -> int:
    """Sessions inside an INSERT into this test's dedup table that has not returned."""
    query = {
        "postgres": "SELECT count(*) FROM pg_stat_activity "
                    "WHERE wait_event_type = 'Lock' AND query LIKE :insert",
        "mysql": "SELECT count(*) FROM information_schema.processlist "
                 "WHERE command = 'Query' AND info LIKE :insert",
    }[db.kind]
    insert = f"INSERT INTO {db.checker.store.table.name} %"
    with db.checker.engine.connect() as conn:
        return int(conn.execute(sa.text(query), {"insert": insert}).scalar_one())


def test_a_concurrent_duplicate_blocks_on_the_key_then_sees_done(db: Db) -> None:
    inside = threading.Event()
    finish = threading.Event()
    outcomes: dict[str, object] = {}

    @idempotent(db.checker, group="payments")
    def handle(message: Message, tx: Connection) -> str:
        tx.execute(db.payments.insert().values(order_id=message.key, amount=message.body))
        inside.set()
        assert finish.wait(10)
        return message.id

    def deliver(name: str) -> None:
        try:
            outcomes[name] = handle(Message(10, id=name, key="o-1"))
        except Exception as exc:  # pragma: no cover - reported by the assertion below
            outcomes[name] = exc

    first = threading.Thread(target=deliver, args=("first",))
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=deliver, args=("second",))
    second.start()
    if db.kind != "sqlite":  # see the duplicate actually wait on the unique key
        tenacity.Retrying(stop=tenacity.stop_after_delay(10), wait=tenacity.wait_fixed(0.02),
                          retry=tenacity.retry_if_result(lambda n: n < 1),
                          reraise=True)(_waiting_inserts, db)
        assert second.is_alive()
    finish.set()
    first.join(10)
    second.join(10)
    assert outcomes == {"first": "first", "second": None}
    assert db.paid() == ["o-1"]


def test_claim_many_inside_a_callers_transaction(db: Db) -> None:
    checker = db.checker
    with checker.engine.begin() as tx:
        claims = checker.claim_many(["a", "b", "a"], group="batch", tx=tx)
        assert [c.status for c in claims] == [Status.CLAIMED, Status.CLAIMED, Status.IN_PROGRESS]
        tx.execute(db.payments.insert(), [{"order_id": c.key, "amount": 1}
                                          for c in claims if c.claimed])
    with checker.engine.connect() as tx:
        claims = checker.claim_many(["b", "c"], group="batch", tx=tx)
        assert [c.status for c in claims] == [Status.DONE, Status.CLAIMED]
        tx.rollback()  # the batch write failed
    with checker.engine.begin() as tx:
        claims = checker.claim_many(["b", "c"], group="batch", tx=tx)
        assert [c.status for c in claims] == [Status.DONE, Status.CLAIMED]  # c rolled back
    assert checker.complete_many(claims) == [True, True]
    with pytest.raises(ConfigurationError, match="tx="):
        checker.claim_many(["x"])


def test_a_live_lease_of_a_sqlchecker_on_the_same_table_means_in_progress(db: Db) -> None:
    lease_checker = SqlChecker(db.checker.engine, db.checker.store.table.name)
    held = lease_checker.claim("o-1", group="payments")
    assert held.claimed
    with pytest.raises(InProgress):
        pay(db)(Message(10, key="o-1"))
    assert db.paid() == []


def test_a_failed_commit_asks_for_a_retry_and_the_retry_applies_it_once(db: Db) -> None:
    fail = {"commit": True}

    def lose_commit(conn: Connection) -> None:
        if fail.pop("commit", False):
            raise sa.exc.OperationalError("COMMIT", {}, Exception("connection lost"))

    sa.event.listen(db.checker.engine, "commit", lose_commit)
    try:
        with pytest.raises(NeedRetry, match="outcome unknown"):
            pay(db)(Message(10, key="o-1"))
        assert db.paid() == []
        assert pay(db)(Message(10, key="o-1")) == "paid"
    finally:
        sa.event.remove(db.checker.engine, "commit", lose_commit)
    assert db.paid() == ["o-1"]


def test_fail_open_is_refused(db: Db) -> None:
    with pytest.raises(ConfigurationError, match="fail_open"):
        idempotent(db.checker, fail_open=True)(lambda m, tx: None)(Message(1, key="k"))
