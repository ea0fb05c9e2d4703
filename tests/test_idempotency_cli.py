"""``msgpatterns dedup purge`` through the real command-line entry point."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from msgpatterns.cli import main
from msgpatterns.cli.dedup import parse_age
from msgpatterns.idempotency import SqlChecker, Status
from msgpatterns.testing.checker_fixtures import FakeClock

DAY = 86400.0


OLD = 6_000


def fill(url: str, table: str) -> SqlChecker:
    """6,000 records that expired 29 days ago, one live lease, one fresh DONE record."""
    month_ago = FakeClock(time.time() - 30 * DAY)
    old = SqlChecker(url, table, ttl=DAY, clock=month_ago)
    claims = old.claim_many([f"old-{i}" for i in range(OLD)])
    assert old.complete_many(claims) == [True] * OLD
    now = SqlChecker(url, table, ttl=DAY)
    assert now.claim("live").claimed
    now.complete(now.claim("fresh"))
    old.close()
    return now


@pytest.mark.parametrize(("text", "seconds"), [
    ("7d", 7 * DAY), ("12h", 43200), ("1d12h", 1.5 * DAY), ("90m", 5400), ("45", 45),
    ("0.5s", 0.5), ("2w", 14 * DAY), ("250ms", 0.25),
])
def test_ages(text: str, seconds: float) -> None:
    assert parse_age(text) == seconds


@pytest.mark.parametrize("text", ["", "7x", "d7", "7d-", "-7d", "7 d"])
def test_bad_ages_are_refused(text: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["dedup", "purge", "--url", "sqlite://", "--older-than", text])
    assert exited.value.code == 2


def test_purge_deletes_expired_records_in_chunks_and_keeps_live_ones(
    sql_url: str, unique: str, capsys: pytest.CaptureFixture[str],
) -> None:
    table = f"dedup_{unique}"
    checker = fill(sql_url, table)
    try:
        assert main(["dedup", "purge", "--url", sql_url, "--table", table,
                     "--older-than", "40d", "--no-progress"]) == 0
        assert "purged 0 expired record(s)" in capsys.readouterr().out  # 29 days ago only

        assert main(["dedup", "purge", "--url", sql_url, "--table", table,
                     "--older-than", "7d", "--chunk", "2500"]) == 0
        captured = capsys.readouterr()
        assert f"purged {OLD} expired record(s) from {table}" in captured.out
        assert f"{OLD}/{OLD}" in captured.err  # the progress bar reached the end
        assert checker.count_expired() == 0
        assert [c.status for c in checker.claim_many(["live", "fresh", "old-1"])] == \
            [Status.IN_PROGRESS, Status.DONE, Status.CLAIMED]
    finally:
        checker.store.table.drop()
        checker.close()


def test_purge_of_a_missing_table_fails_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    assert main(["dedup", "purge", "--url", url, "--table", "nope"]) == 1
    assert "no table 'nope'" in capsys.readouterr().err


def test_purge_on_redis_is_a_no_op(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dedup", "purge", "--url", "redis://127.0.0.1:1/0"]) == 0
    assert "nothing to purge" in capsys.readouterr().out
