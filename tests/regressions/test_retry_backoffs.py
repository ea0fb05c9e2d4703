"""Retry schedules everywhere: one vocabulary. Every part that retries - the checkers'
StorePolicy (and the specs that rebuild it), optimistic_update, the adapters' reconnect
policy - takes a :class:`~msgpatterns.Backoff`, which is also tenacity's ``wait=``; the
old keyword names still work. (Item 5 of issue 11.)"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import tenacity

from msgpatterns import Backoff
from msgpatterns.brokers._reconnect import reconnecting
from msgpatterns.errors import ConfigurationError, StoreUnavailable
from msgpatterns.idempotency import StorePolicy
from msgpatterns.idempotency.spec import checker_from_spec
from msgpatterns.ordering import optimistic_update

# -- a Backoff is what every retrying part takes -----------------------------------


def test_store_policy_takes_a_backoff_and_keeps_wait_and_max_wait() -> None:
    """StorePolicy(backoff=...) is the schedule; wait/max_wait still mean the
    doubling wait they meant (tenacity's wait_exponential with min=wait)."""
    levels = Backoff.levels([0.0, 0.5])
    assert StorePolicy(backoff=levels).schedule is levels
    assert isinstance(StorePolicy(backoff=tenacity.wait_fixed(0.1)).schedule, Backoff)
    old = tenacity.wait_exponential(multiplier=0.2, min=0.2, max=2.0)
    schedule = StorePolicy(wait=0.2, max_wait=2.0).schedule
    for attempt in range(1, 8):
        state = tenacity.RetryCallState(tenacity.Retrying(), None, (), {})
        state.attempt_number = attempt
        assert schedule.delay(attempt) == pytest.approx(old(state))
    with pytest.raises(ConfigurationError):
        StorePolicy(attempts=0)


def test_store_policy_call_waits_its_backoff() -> None:
    """StorePolicy.call retries transient errors waiting the Backoff asked per
    attempt, then raises StoreUnavailable."""
    asked: list[int] = []

    class Recording(Backoff):
        def delay(self, attempt: int) -> float:
            asked.append(attempt)
            return 0.0

    calls: list[int] = []

    def failing() -> None:
        calls.append(1)
        raise ConnectionError("down")

    with pytest.raises(StoreUnavailable):
        StorePolicy(attempts=3, backoff=Recording()).call(
            failing, (ConnectionError,), what="probe")
    assert len(calls) == 3
    assert asked[:2] == [1, 2]  # tenacity may also ask before it decides to stop


def test_a_spec_carries_the_policy_backoff(tmp_path: Path) -> None:
    """a checker's spec rebuilds the same policy, backoff included."""
    from msgpatterns.idempotency import SqlChecker

    policy = StorePolicy(attempts=4, backoff=Backoff.levels([0.0, 0.1]))
    checker = SqlChecker(f"sqlite:///{tmp_path / 'd.db'}", policy=policy)
    spec = checker.spec()
    checker.close()
    assert spec.options["policy"]["backoff"] is policy.backoff
    rebuilt = checker_from_spec(spec)
    try:
        assert rebuilt.policy.schedule is policy.backoff  # type: ignore[attr-defined]
    finally:
        rebuilt.close()


def test_optimistic_update_takes_backoff_and_its_old_name() -> None:
    """optimistic_update(backoff=...) pauses per the Backoff; wait= still works;
    both at once is refused before anything runs."""
    asked: list[int] = []

    class Recording(Backoff):
        def delay(self, attempt: int) -> float:
            asked.append(attempt)
            return 0.0

    rounds = iter([False, False, True])
    assert optimistic_update(lambda: 1, lambda c: c + 1, lambda c, m: next(rounds),
                             backoff=Recording()) == 2
    assert asked == [1, 2]
    rounds = iter([False, True])
    assert optimistic_update(lambda: 1, lambda c: c + 1, lambda c, m: next(rounds),
                             wait=tenacity.wait_none()) == 2
    with pytest.raises(ConfigurationError, match="not both"):
        optimistic_update(backoff=Backoff.fixed(0), wait=tenacity.wait_none())


def test_reconnecting_waits_the_backoff_it_is_given() -> None:
    """the adapters' reconnect policy takes a Backoff (max_wait still works)."""
    schedule = Backoff.levels([0.0])
    retrying = reconnecting((ConnectionError,), logger=logging.getLogger("t"), what="t",
                            attempts=2, backoff=schedule)
    assert retrying.wait is schedule
    legacy = reconnecting((ConnectionError,), logger=logging.getLogger("t"), what="t",
                          attempts=2, max_wait=0.5)
    assert all(legacy.wait.delay(n) <= 0.5 for n in range(1, 20))  # type: ignore[attr-defined]


def test_a_backoff_is_its_own_tenacity_wait() -> None:
    """Backoff.as_tenacity() is the Backoff, usable as tenacity's wait=."""
    schedule = Backoff.fixed(0) + tenacity.wait_none()
    assert schedule.as_tenacity() is schedule
    calls = iter([ValueError(), None])

    def flaky() -> str:
        error = next(calls)
        if error is not None:
            raise error
        return "ok"

    assert tenacity.Retrying(wait=schedule.as_tenacity(),
                             stop=tenacity.stop_after_attempt(2))(flaky) == "ok"
