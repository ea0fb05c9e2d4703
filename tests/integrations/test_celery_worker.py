"""Celery integration with a real worker (in a thread) on the real Redis: a duplicate
delivery runs the body once, retries follow the policy's countdown with a durable
attempt count, a Reject fails the task without retry and is recorded as a dead letter
(issue 13, item 2)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

pytest.importorskip("celery")

from celery import Celery
from celery.contrib.testing.worker import start_worker

from msgpatterns import Backoff, MemoryChecker, Reject, RetryPolicy
from msgpatterns.deadletter import MemoryDeadLetterStore
from msgpatterns.integrations.celery import idempotent_task

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

DELAY = 0.5
POLICY = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(DELAY), local_retries=0)


def until(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < give_up, "timed out"
        time.sleep(0.02)


class Tasks:
    def __init__(self, app: Celery) -> None:
        self.checker = MemoryChecker()
        self.store = MemoryDeadLetterStore()
        self.charged: list[str] = []
        self.tries: list[float] = []
        self.rejected = 0
        self.lock = threading.Lock()

        @idempotent_task(app, self.checker, key=lambda order_id, amount: order_id,
                         policy=POLICY, dead_letters=self.store, name="test.charge")
        def charge(order_id: str, amount: int) -> None:
            with self.lock:
                self.charged.append(order_id)

        @idempotent_task(app, policy=POLICY, dead_letters=self.store, name="test.flaky")
        def flaky() -> str:
            self.tries.append(time.monotonic())
            if len(self.tries) < 3:
                raise TimeoutError("ledger busy")
            return "done"

        @idempotent_task(app, policy=POLICY, dead_letters=self.store, name="test.refund")
        def refund(order_id: str) -> None:
            self.rejected += 1
            raise Reject(f"unknown order {order_id}")

        @idempotent_task(app, policy=POLICY, dead_letters=self.store, name="test.broken")
        def broken() -> None:
            raise ValueError("always")

        self.charge, self.flaky, self.refund, self.broken = charge, flaky, refund, broken


@pytest.fixture
def worker_app(redis_url: str, unique: str) -> Iterator[Celery]:
    base = redis_url.rsplit("/", 1)[0] if redis_url.count("/") > 2 else redis_url
    app = Celery(f"msgpatterns-test-{unique}", broker=f"{base}/14")
    app.conf.update(task_default_queue=f"celery-{unique}", worker_hijack_root_logger=False,
                    broker_connection_retry_on_startup=True, task_acks_late=True)
    # The test worker sets the root logger's level (to ERROR); put it back, or every
    # later test that reads warnings through caplog sees nothing.
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    try:
        yield app
    finally:
        root.setLevel(level)
        root.handlers[:] = handlers
    import redis

    client = redis.Redis.from_url(f"{base}/14")
    try:
        client.delete(f"celery-{unique}", f"_kombu.binding.celery-{unique}")
    finally:
        client.close()


def test_duplicates_retries_and_dead_letters_with_a_real_worker(worker_app: Celery) -> None:
    tasks = Tasks(worker_app)
    with start_worker(worker_app, pool="solo", perform_ping_check=False,
                      shutdown_timeout=10):
        tasks.charge.apply_async(("o-1", 500), task_id="t-1")
        tasks.charge.apply_async(("o-1", 500), task_id="t-1")  # the same delivery again
        tasks.charge.apply_async(("o-1", 500), task_id="t-2")  # the same order, new id
        tasks.flaky.apply_async()
        tasks.refund.apply_async(("o-9",), task_id="r-1")
        tasks.broken.apply_async(task_id="b-1")
        until(lambda: tasks.checker.stats.duplicates == 2 and len(tasks.tries) == 3
              and len(tasks.store) == 2)

    assert tasks.charged == ["o-1"]
    gaps = [b - a for a, b in zip(tasks.tries, tasks.tries[1:], strict=False)]
    # countdown = the policy delay; Celery turns it into a wall-clock ETA (no early margin)
    assert all(gap >= DELAY * 0.95 for gap in gaps), gaps
    assert tasks.rejected == 1  # no retry after a Reject
    records = {r.message.id: r for r in tasks.store.records}
    rejected, exhausted = records["r-1"], records["b-1"]
    assert rejected.message.topic == "test.refund"
    assert rejected.reason == "rejected: unknown order o-9"
    assert rejected.attempts == 1
    assert exhausted.attempts == 3  # Celery's request.retries carried the count
    assert exhausted.error_type == "builtins.ValueError"


@pytest.mark.postgres
def test_transactional_sql_checker_runs_the_task_in_its_transaction(
        worker_app: Celery, postgres_url: str, unique: str) -> None:
    """Issue 19 hole 8: a task on a TransactionalSqlChecker gets the checker's open
    transaction as ``tx``; its write and the key commit together (exactly once), a
    failing attempt rolls both back and the retry runs it again."""
    import sqlalchemy as sa

    from msgpatterns import TransactionalSqlChecker

    engine = sa.create_engine(postgres_url)
    table = f"charges_{unique}"
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {table} (order_id text PRIMARY KEY, amount int)"))
    checker = TransactionalSqlChecker(engine, table=f"dedup_{unique}")
    failures = [1]

    @idempotent_task(worker_app, checker, key=lambda order_id, amount: order_id,
                     policy=POLICY, name="test.charge_tx")
    def charge(order_id: str, amount: int, *, tx: sa.Connection) -> None:
        tx.execute(sa.text(f"INSERT INTO {table} VALUES (:o, :a)"),
                   {"o": order_id, "a": amount})
        if failures:
            failures.pop()
            raise TimeoutError("ledger busy")  # rolls the insert and the claim back

    def rows() -> list[tuple[str, int]]:
        with engine.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(f"SELECT * FROM {table}"))]

    try:
        with start_worker(worker_app, pool="solo", perform_ping_check=False,
                          shutdown_timeout=10):
            charge.apply_async(("o-1", 500), task_id="tx-1")
            until(lambda: len(rows()) == 1 and not failures)
            charge.apply_async(("o-1", 500), task_id="tx-2")  # same order, new id
            until(lambda: checker.stats.duplicates == 1)
        assert rows() == [("o-1", 500)]
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {table}"))
            conn.execute(sa.text(f"DROP TABLE IF EXISTS dedup_{unique}"))
        engine.dispose()


def test_transactional_checker_task_without_tx_is_refused_with_a_reason(
        worker_app: Celery, tmp_path: object) -> None:
    from msgpatterns import TransactionalSqlChecker
    from msgpatterns.errors import ConfigurationError

    checker = TransactionalSqlChecker(f"sqlite:///{tmp_path}/d.db")
    with pytest.raises(ConfigurationError, match=r"no 'tx' parameter.*tx=") as info:
        @idempotent_task(worker_app, checker, name="test.no_tx")
        def charge(order_id: str) -> None: ...
    assert "<locals>.body" not in str(info.value)


def test_an_async_checker_is_refused_naming_the_sync_one(worker_app: Celery) -> None:
    from msgpatterns.errors import ConfigurationError
    from msgpatterns.idempotency import AsyncRedisChecker

    checker = AsyncRedisChecker("redis://127.0.0.1:1/0")
    with pytest.raises(ConfigurationError, match="use RedisChecker") as info:
        @idempotent_task(worker_app, checker, name="test.async_checker")
        def charge(order_id: str) -> None: ...
    assert "<locals>" not in str(info.value)
