"""Issue 11 (items 5, 6, 7): one retry vocabulary, one home for SQL plumbing, the
command and the demos outside the library."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
import tenacity

from msgpatterns import Backoff
from msgpatterns._sql import OnFirstUse, create_table, family, transient_errors
from msgpatterns.brokers._reconnect import reconnecting
from msgpatterns.errors import ConfigurationError, StoreUnavailable
from msgpatterns.idempotency import StorePolicy
from msgpatterns.idempotency.spec import checker_from_spec
from msgpatterns.ordering import optimistic_update

# -- item 5: a Backoff is what every retrying part takes -----------------------------------


def test_store_policy_takes_a_backoff_and_keeps_wait_and_max_wait() -> None:
    """Item 5: StorePolicy(backoff=...) is the schedule; wait/max_wait still mean the
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
    """Item 5: StorePolicy.call retries transient errors waiting the Backoff asked per
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
    """Item 5: a checker's spec rebuilds the same policy, backoff included."""
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
    """Item 5: optimistic_update(backoff=...) pauses per the Backoff; wait= still works;
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
    """Item 5: the adapters' reconnect policy takes a Backoff (max_wait still works)."""
    schedule = Backoff.levels([0.0])
    retrying = reconnecting((ConnectionError,), logger=logging.getLogger("t"), what="t",
                            attempts=2, backoff=schedule)
    assert retrying.wait is schedule
    legacy = reconnecting((ConnectionError,), logger=logging.getLogger("t"), what="t",
                          attempts=2, max_wait=0.5)
    assert all(legacy.wait.delay(n) <= 0.5 for n in range(1, 20))  # type: ignore[attr-defined]


def test_a_backoff_is_its_own_tenacity_wait() -> None:
    """Item 5: Backoff.as_tenacity() is the Backoff, usable as tenacity's wait=."""
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


# -- item 6: SQL plumbing in msgpatterns._sql -----------------------------------------------


def test_create_table_is_safe_to_race_and_once_per_process(tmp_path: Path) -> None:
    """Item 6: create_table reports whether it created the table; a second creator (the
    table exists) gets False, never an error; OnFirstUse runs its action once."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 't.db'}")
    table = sa.Table("t", sa.MetaData(), sa.Column("k", sa.Integer, primary_key=True))
    assert create_table(engine, table) is True
    assert create_table(engine, table) is False
    runs: list[int] = []
    once = OnFirstUse(lambda: runs.append(1))
    once()
    once()
    assert runs == [1]
    once.reset()
    once()
    assert runs == [1, 1]
    engine.dispose()


def test_dialects_and_transient_errors_come_from_one_place() -> None:
    """Item 6: one family() for every SQL user, naming the part on an unknown database;
    one list of transient errors (plus the driver's own when a dialect is given)."""
    engine = sa.create_engine("sqlite://")
    assert family(engine) == "sqlite"
    assert sa.exc.OperationalError in transient_errors()
    assert engine.dialect.loaded_dbapi.OperationalError in transient_errors(engine.dialect)
    from sqlalchemy.dialects import oracle

    with pytest.raises(ConfigurationError, match="SqlSink"):
        family(oracle.dialect(), what="SqlSink")
    engine.dispose()


# -- item 7: application code outside the library --------------------------------------------


def test_importing_the_library_loads_no_command_demo_or_test_helper() -> None:
    """Item 7: `import msgpatterns` (and the parts) never import the command, the demos
    or the test helpers."""
    code = ("import sys, msgpatterns, msgpatterns.brokers, msgpatterns.idempotency, "
            "msgpatterns.ordering; "
            "bad = [m for m in sys.modules if m.startswith(('msgpatterns.cli', "
            "'msgpatterns.demo', 'msgpatterns.testing'))]; print(bad); "
            "sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_subcommands_are_registered_explicitly() -> None:
    """Item 7: the command's subcommands are the modules of msgpatterns.cli, in order."""
    from msgpatterns import cli

    assert [r.__module__ for r in cli.COMMANDS] == [
        "msgpatterns.cli.demo", "msgpatterns.cli.dedup", "msgpatterns.cli.dlq",
        "msgpatterns.cli.topic"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
