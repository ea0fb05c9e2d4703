"""MsgpatternsMiddleware on Dramatiq's StubBroker (in-process worker, no server): the
outcome table, and a dead-letter store that fails still leaves the message in
Dramatiq's dead-letter queue."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("dramatiq")

import dramatiq
from dramatiq.brokers.stub import StubBroker

from msgpatterns import Backoff, NeedRetry, Reject, RetryPolicy
from msgpatterns.deadletter import DeadLetter, MemoryDeadLetterStore
from msgpatterns.integrations.dramatiq import current_message, message_id, use_msgpatterns

POLICY = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(0.01), local_retries=2,
                     local_backoff=0.0)


class Failing:
    def put(self, record: DeadLetter) -> None:
        raise ConnectionError("store down")


@pytest.fixture
def broker() -> Iterator[StubBroker]:
    stub = StubBroker()
    stub.emit_after("process_boot")
    yield stub
    stub.close()


def run(broker: StubBroker) -> None:
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=50)
    worker.start()
    try:
        broker.join("q", fail_fast=False)
        worker.join()
    finally:
        worker.stop()


def test_outcomes(broker: StubBroker) -> None:
    store = MemoryDeadLetterStore()
    use_msgpatterns(broker, POLICY, dead_letters=store)
    seen: list[tuple[str, int, int]] = []

    @dramatiq.actor(broker=broker, queue_name="q", throws=(KeyError,))
    def act(kind: str) -> None:
        m = current_message()
        seen.append((kind, m.attempt, m.local_retries))
        assert message_id() == m.id
        if kind == "local" and m.local_retries < 2:
            raise NeedRetry()  # in-process, same worker thread
        if kind == "later" and m.attempt < 2:
            raise NeedRetry(0.01)  # re-enqueued with Dramatiq's delay
        if kind == "dramatiq-retry" and m.attempt < 2:
            raise dramatiq.Retry(delay=10)
        if kind == "reject":
            raise Reject("bad input")
        if kind == "throws":
            raise KeyError("expected")
        if kind == "broken":
            raise ValueError("always")

    for kind in ("ok", "local", "later", "dramatiq-retry", "reject", "throws", "broken"):
        act.send(kind)
    run(broker)

    def runs(kind: str) -> list[tuple[int, int]]:
        return [(a, lr) for k, a, lr in seen if k == kind]

    assert runs("ok") == [(1, 0)]
    assert runs("local") == [(1, 0), (1, 1), (1, 2)]
    assert runs("later") == [(1, 0), (2, 0)]
    assert runs("dramatiq-retry") == [(1, 0), (2, 0)]
    assert runs("reject") == [(1, 0)]
    assert runs("throws") == [(1, 0)]
    assert runs("broken") == [(1, 0), (2, 0), (3, 0)]  # errors are redelivered
    reasons = {r.reason.split(":")[0]: r.attempts for r in store.records}
    assert reasons == {"rejected": 1, "expected exception (throws)": 1,
                       "gave up after 3 attempts": 3}
    assert len(broker.dead_letters) == 3  # Dramatiq's own XQ holds them too


def test_a_failing_store_still_dead_letters_into_dramatiq(broker: StubBroker,
                                                          caplog: Any) -> None:
    use_msgpatterns(broker, POLICY, dead_letters=Failing())

    @dramatiq.actor(broker=broker, queue_name="q")
    def act() -> None:
        raise Reject("bad")

    act.send()
    run(broker)
    assert len(broker.dead_letters) == 1
    assert "keeping its dead-letter record failed" in caplog.text
