"""The pytest plugin's checker fixtures, used the way a user's tests would."""

from __future__ import annotations

import pytest

from msgpatterns import Message
from msgpatterns.idempotency import Checker, MemoryChecker, RedisChecker, SqlChecker, idempotent
from msgpatterns.testing import EffectLog


@pytest.mark.parametrize("name", ["memory_checker", "redis_checker", "sql_checker"])
def test_each_checker_fixture_dedups(name: str, request: pytest.FixtureRequest) -> None:
    checker: Checker = request.getfixturevalue(name)
    effects = EffectLog()

    @idempotent(checker)
    def handle(message: Message) -> None:
        effects.record(message.key)

    for _ in range(3):
        handle(Message(b"", key="order-1"))
    effects.assert_exactly_once(["order-1"])


def test_fixture_types(memory_checker: MemoryChecker, redis_checker: RedisChecker,
                       sql_checker: SqlChecker) -> None:
    assert isinstance(memory_checker, MemoryChecker)
    assert isinstance(redis_checker, RedisChecker)
    assert isinstance(sql_checker, SqlChecker)
    assert sql_checker.engine.dialect.name == "sqlite"
