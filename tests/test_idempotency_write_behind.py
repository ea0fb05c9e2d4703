"""Write-behind completion: one store round trip per message, completions batched in
the background, the same exactly-once effects without crashes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from msgpatterns import Consumer, InMemoryBroker, Message
from msgpatterns.errors import ConfigurationError, IdempotencyConflict, InProgress
from msgpatterns.idempotency import LeaseChecker, RedisChecker, SqlChecker, Status, idempotent
from msgpatterns.testing import EffectLog, assert_all_acked
from msgpatterns.testing.checker_fixtures import checker_for, store_params

STORES = store_params("fakeredis", "sqlite", "redis", "postgres")


@pytest.fixture(params=STORES)
def checker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LeaseChecker]:
    with checker_for(request.param, tmp_path, write_behind=0.01) as built:
        assert isinstance(built, LeaseChecker)
        yield built


def test_completions_are_written_in_the_background(checker: LeaseChecker) -> None:
    effects = EffectLog()

    @idempotent(checker, group="g", key=lambda key, amount: key,
                fingerprint=lambda key, amount: amount)
    def handle(key: str, amount: str) -> str:
        effects.record(key)
        return "ran"

    assert handle("o-1", "10") == "ran"
    assert handle("o-1", "10") is None  # a local duplicate: skipped before any round trip
    assert checker.stats.claimed == 1 and checker.stats.duplicates == 1
    with pytest.raises(IdempotencyConflict):
        handle("o-1", "99")
    assert checker.flush(5)
    assert checker.stats.completed == 1
    assert checker.claim("o-1", group="g").status is Status.DONE  # written to the store
    effects.assert_exactly_once(["o-1"])


@pytest.mark.parametrize("store", STORES)
def test_another_process_sees_the_key_in_progress_until_the_completion_is_written(
    store: str, tmp_path: Path,
) -> None:
    with checker_for(store, tmp_path, write_behind=5.0) as checker:
        assert isinstance(checker, LeaseChecker)
        other: LeaseChecker
        if isinstance(checker, RedisChecker) and checker.url is None:  # fakeredis
            other = RedisChecker(checker.client, checker.namespace)
        else:
            other = checker.spec().build()  # type: ignore[assignment]
        assert checker.execute("o-1", lambda tx: "ran").result == "ran"
        with pytest.raises(InProgress):  # held by the queued completion's token
            other.execute("o-1", lambda tx: pytest.fail("applied twice"))
        assert checker.flush(5)
        assert not other.execute("o-1", lambda tx: pytest.fail("applied twice")).ran


def test_exactly_once_through_the_consumer(checker: LeaseChecker) -> None:
    broker = InMemoryBroker(seed=5, duplicate_rate=0.3, lost_ack_rate=0.2, reorder_window=4)
    keys = [f"o-{i}" for i in range(60)]
    for key in keys:
        broker.publish("orders", b"x", key=key)
    effects = EffectLog()

    @idempotent(checker)
    def handle(message: Message) -> None:
        effects.record(message.key)

    Consumer(broker, handle, topics=["orders"], group="g", workers=3).run_until_idle(60)
    checker.close()
    effects.assert_exactly_once(keys)
    assert_all_acked(broker)
    assert checker.stats.completed == 60


def test_close_writes_what_is_queued(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'dedup.db'}"
    checker = SqlChecker(url, write_behind=5.0, lease=30)  # far longer than the test
    for i in range(10):
        checker.execute(f"k{i}", lambda tx: None)
    checker.close()
    reader = SqlChecker(url)
    assert all(c.status is Status.DONE for c in reader.claim_many([f"k{i}" for i in range(10)]))


def test_write_behind_must_be_shorter_than_the_lease(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="write_behind"):
        SqlChecker(f"sqlite:///{tmp_path / 'x.db'}", lease=1, write_behind=1)
