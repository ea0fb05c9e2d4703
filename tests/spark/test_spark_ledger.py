"""BatchLedger on SQLite, PostgreSQL and MariaDB (no Spark needed)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency import StorePolicy
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


@pytest.mark.postgres
def test_a_ledger_on_a_user_engine_survives_backend_kills(postgres_url: str, unique: str) -> None:
    """Hole 12 (BatchLedger): the ledger switched the user's pooled connections to
    AUTOCOMMIT per checkout; when PostgreSQL dropped sessions, resetting the isolation
    level at check-in failed and connections never went back to the pool, until every
    thread blocked in the pool (the same load hung for minutes). Now 4 threads recording
    and reading 30 batches each survive 12 kills of our own backends, and the pool ends
    with nothing checked out."""
    app = f"mp-ledger-{unique}"
    engine = sa.create_engine(postgres_url, pool_size=2, max_overflow=0, pool_timeout=2,
                              connect_args={"application_name": app})
    admin = sa.create_engine(postgres_url, poolclass=sa.pool.NullPool)
    ledger = BatchLedger(engine, table=f"ledger_{unique}",
                         policy=StorePolicy(attempts=5, wait=0.01))
    ledger.create_table()
    errors: list[BaseException] = []

    def kill_our_backends() -> None:
        with admin.connect() as conn:
            conn.execute(sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = :app"), {"app": app})

    def work(query: str) -> None:
        try:
            for batch in range(30):
                assert ledger.record("orders", query, batch) is True
                assert ledger.is_recorded("orders", query, batch)
                assert ledger.last_batch("orders", query) == batch
                if batch % 10 == 9:
                    kill_our_backends()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(f"q{n}",), daemon=True) for n in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads), "threads blocked in the pool"
        assert errors == []
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP TABLE IF EXISTS ledger_{unique}"))
        admin.dispose()


def test_a_ledger_leaves_the_user_engines_connections_untouched(sqlite_url: str) -> None:
    """Hole 12 (BatchLedger): no isolation level is set on connections of an engine
    the ledger did not create (it would have to be reset at check-in)."""
    engine = sa.create_engine(sqlite_url, poolclass=sa.pool.QueuePool, pool_size=1)
    levels: list[str] = []

    @sa.event.listens_for(engine, "engine_connect")
    def on_connect(conn: sa.Connection) -> None:
        levels.append(conn.get_execution_options().get("isolation_level", "default"))

    ledger = BatchLedger(engine, table="ledger_untouched")
    assert ledger.record("orders", "q", 0)
    assert ledger.is_recorded("orders", "q", 0)
    assert ledger.last_batch("orders", "q") == 0
    assert ledger.forget("orders") == 1
    assert levels and set(levels) == {"default"}
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    engine.dispose()


def test_the_ledger_and_the_sink_pickle_and_build_their_engine_where_they_land(
    tmp_path: Path,
) -> None:
    """Spark Connect pickles the foreachBatch function to its server."""
    import pickle

    from msgpatterns.spark import idempotent_batch

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    ledger = BatchLedger(sa.create_engine(url), table="ledger", retain=5, scope="sink")
    sink = idempotent_batch(print, ledger, "sink-a", checkpoint="/checkpoints/a")
    copy = pickle.loads(pickle.dumps(sink))
    assert (copy.sink_id, copy.checkpoint, copy.ledger.scope, copy.ledger.retain) == \
        ("sink-a", "/checkpoints/a", "sink", 5)
    assert copy.ledger.record("sink-a", "", 3)
    assert ledger.is_recorded("sink-a", "", 3)  # the same database, its own engine
    assert "password" not in repr(BatchLedger("postgresql://u:password@h/db"))
