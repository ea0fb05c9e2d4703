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
