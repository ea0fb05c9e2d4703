"""The pytest plugin is installed with the package and its fixtures need no set-up."""

from __future__ import annotations

import pytest

from msgpatterns import InMemoryBroker, Message, Reject
from msgpatterns.testing import (
    EffectLog,
    assert_all_acked,
    assert_dead_lettered,
    assert_no_dead_letters,
)
from msgpatterns.testing.plugin import ConsumeFn

USER_TEST = '''
from msgpatterns.testing import assert_all_acked

def handle(message, effects):
    effects.record(message.key)

def test_user_handler(fake_broker, consume, effects):
    for i in range(10):
        fake_broker.publish("orders", {"n": i}, key=f"order-{i}")
    consume(lambda m: handle(m, effects), topic="orders")
    assert_all_acked(fake_broker)
    effects.assert_exactly_once(f"order-{i}" for i in range(10))

def test_failing_assertion_is_readable(fake_broker, consume):
    fake_broker.publish("orders", b"x")
    assert_all_acked(fake_broker)
'''


def test_plugin_is_loaded_through_its_entry_point(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_user=USER_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*not every message acked exactly once*1 message(s) never acked*"])


def test_fixtures_in_our_own_suite(
    fake_broker: InMemoryBroker, consume: ConsumeFn, effects: EffectLog
) -> None:
    fake_broker.publish("test", b"ok", key="a")
    fake_broker.publish("test", b"bad", key="b")

    def handler(message: Message) -> None:
        if message.body == b"bad":
            raise Reject("bad body")
        effects.record(message.key)

    consume(handler)
    effects.assert_exactly_once(["a"])
    assert_dead_lettered(fake_broker, 1, reason="bad body")
    with pytest.raises(AssertionError, match="dead letter"):
        assert_no_dead_letters(fake_broker)
    assert_all_acked(fake_broker, allow_dead=True)


def test_effect_log_reports_double_and_missing_effects() -> None:
    effects = EffectLog()
    effects.record("a")
    effects.record("a")
    effects.record("c")
    with pytest.raises(AssertionError) as info:
        effects.assert_exactly_once(["a", "b"])
    text = str(info.value)
    assert "more than once" in text
    assert "never applied" in text
    assert "unexpected" in text
