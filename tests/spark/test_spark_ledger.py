"""BatchLedger on SQLite, PostgreSQL and MariaDB (no Spark needed)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from msgpatterns.errors import ConfigurationError
from msgpatterns.spark import BatchLedger


@pytest.fixture
def ledger(sql_url: str, unique: str) -> Iterator[BatchLedger]:
    ledger = BatchLedger(sql_url, table=f"ledger_{unique}", retain=3)
    yield ledger
    ledger.drop_table()


def test_a_batch_is_recorded_once_per_sink_and_query(ledger: BatchLedger) -> None:
    assert not ledger.is_recorded("orders", "q1", 0)
    assert ledger.record("orders", "q1", 0) is True
    assert ledger.record("orders", "q1", 0) is False  # a second run of the same batch
    assert ledger.is_recorded("orders", "q1", 0)
    # the same batch id of another query (a new checkpoint) or another sink is new
    assert not ledger.is_recorded("orders", "q2", 0)
    assert not ledger.is_recorded("payments", "q1", 0)
    assert ledger.last_batch("orders", "q1") == 0
    assert ledger.last_batch("orders", "q2") is None


def test_old_batches_are_pruned_but_recent_ones_kept(ledger: BatchLedger) -> None:
    for batch in range(7):
        ledger.record("orders", "q1", batch)
    ledger.record("orders", "q2", 0)
    recorded = [b for b in range(7) if ledger.is_recorded("orders", "q1", b)]
    # pruned at batch 6 (a multiple of retain=3): everything at or below 3 went
    assert recorded == [4, 5, 6]
    assert ledger.is_recorded("orders", "q2", 0)  # other queries untouched


def test_a_record_inside_a_transaction_rolls_back_with_it(ledger: BatchLedger) -> None:
    ledger.create_table()

    def failing_write() -> None:
        with ledger.engine.begin() as conn:
            assert ledger.record("orders", "q1", 5, conn=conn)
            raise RuntimeError("the sink's write failed")

    with pytest.raises(RuntimeError):
        failing_write()
    assert not ledger.is_recorded("orders", "q1", 5)
    with ledger.engine.begin() as conn:
        assert ledger.record("orders", "q1", 5, conn=conn)
    assert ledger.is_recorded("orders", "q1", 5)


def test_forget_one_query_or_the_whole_sink(ledger: BatchLedger) -> None:
    for query in ("q1", "q2"):
        ledger.record("orders", query, 0)
        ledger.record("orders", query, 1)
    ledger.record("payments", "q1", 0)
    assert ledger.forget("orders", "q1") == 2
    assert ledger.is_recorded("orders", "q2", 1)
    assert ledger.forget("orders") == 2
    assert ledger.is_recorded("payments", "q1", 0)


def test_keys_are_data(ledger: BatchLedger) -> None:
    nasty = "x'); DROP TABLE orders; --"
    assert ledger.record(nasty, "q'1", 0)
    assert ledger.is_recorded(nasty, "q'1", 0)
    assert not ledger.is_recorded("x", "q'1", 0)


def test_configuration_errors(sqlite_url: str) -> None:
    with pytest.raises(ConfigurationError):
        BatchLedger(sqlite_url, retain=0)
    ledger = BatchLedger(sqlite_url)
    with pytest.raises(ConfigurationError):
        ledger.record("", "q", 0)
    with pytest.raises(ConfigurationError):
        ledger.record("s" * 201, "q", 0)
    with pytest.raises(ConfigurationError, match="in-memory"):
        BatchLedger("sqlite://")


def test_an_engine_can_be_shared(sqlite_url: str, unique: str) -> None:
    engine = sa.create_engine(sqlite_url)
    ledger = BatchLedger(engine, table=f"ledger_{unique}")
    assert ledger.record("orders", "q", 3)
    with engine.connect() as conn:
        rows = conn.execute(sa.text(f"SELECT sink_id, query_id, batch_id FROM ledger_{unique}"))
        assert rows.all() == [("orders", "q", 3)]
    engine.dispose()
