"""``msgpatterns demo``: exact final state under duplicates, reordering and lost acks."""

from __future__ import annotations

import subprocess
import sys

import pytest

from msgpatterns import InMemoryBroker
from msgpatterns.cli import main
from msgpatterns.demo.orders import _check, run_demo


@pytest.mark.parametrize("seed", [1, 2])
def test_demo_final_state_is_exact_under_faults(seed: int) -> None:
    lines: list[str] = []
    result = run_demo(orders=120, malformed=2, duplicate_rate=0.2, reorder_window=16,
                      lost_ack_rate=0.1, seed=seed, workers=3, progress=False,
                      out=lines.append)
    assert result.exact, result.problems
    assert result.summary["duplicates injected"] > 0
    assert result.summary["duplicates skipped (idempotency)"] > 0
    assert result.summary["dead letters (malformed input)"] == 2
    assert any("Final state exact" in line for line in lines)


@pytest.mark.postgres
def test_demo_on_postgres(postgres_url: str, unique: str) -> None:
    result = run_demo(orders=60, seed=3, db=postgres_url, progress=False, out=lambda s: None,
                      table_prefix=f"demo_{unique}_")
    assert result.exact, result.problems
    import sqlalchemy as sa

    engine = sa.create_engine(postgres_url)
    with engine.begin() as conn:
        for table in ("orders", "payments", "dedup"):
            conn.execute(sa.text(f'DROP TABLE IF EXISTS "demo_{unique}_{table}"'))
    engine.dispose()


def test_the_final_check_catches_a_double_payment_and_a_wrong_state() -> None:
    broker = InMemoryBroker()
    expected = {"orders": {"o1": ("paid", 2)}, "payments": {"o1": 500}}
    actual = {"orders": {"o1": ("created", 1)}, "payments": {"o1": [500, 500]}}
    problems = _check(expected, actual, broker, malformed=0)
    assert any("wrong state" in p for p in problems)
    assert any("paid more than once" in p for p in problems)


def test_cli_demo_exit_code() -> None:
    assert main(["demo", "--orders", "40", "--no-progress", "--seed", "5"]) == 0


def test_python_dash_m() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "msgpatterns", "demo", "--orders", "30", "--no-progress"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "Final state exact" in result.stdout
