"""Properties of VersionGuard under any delivery order, with duplicates and redeliveries.

Messages go through the InMemoryBroker (duplicates, reordering) and the Consumer
(retries, several workers), on SQLite, the real PostgreSQL and the real MariaDB, with
the guard of the sync API and of the async one (AsyncVersionGuard on an AsyncEngine,
its coroutines run on an event loop that every worker thread hands them to). Each
Hypothesis example uses its own tables.
"""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import Column, Engine, Integer, String, Table, Text, select

from msgpatterns import Backoff, Consumer, InMemoryBroker, Message, RetryPolicy
from msgpatterns.testing import assert_all_acked
from ordering_db import MODES, SqlSide, engine_for, sql_side, temp_table


@pytest.fixture
def engine(sql_url: str) -> Iterator[Engine]:
    with engine_for(sql_url) as engine:
        yield engine


@pytest.fixture(params=MODES)
def db(request: pytest.FixtureRequest, engine: Engine) -> Iterator[SqlSide]:
    """The sync API or the async one (AsyncVersionGuard on an AsyncEngine)."""
    with sql_side(request.param, engine) as side:
        yield side


def _examples(db: SqlSide) -> int:
    """Bounded: many on SQLite, fewer on the shared servers, half as many again for the
    async API (its bridge to the sync test body costs a thread hop per statement)."""
    count = 20 if db.engine.dialect.name == "sqlite" else 8
    return count if db.mode == "sync" else count // 2


@dataclass(frozen=True)
class Delivery:
    """How the broker and the consumer treat one example's messages."""

    seed: int
    duplicate_rate: float
    reorder_window: int
    workers: int


deliveries = st.builds(
    Delivery,
    seed=st.integers(0, 2**16),
    duplicate_rate=st.sampled_from([0.0, 0.3]),
    reorder_window=st.integers(0, 5),
    workers=st.sampled_from([1, 3]),
)

RETRY = RetryPolicy(
    max_attempts=500, backoff=Backoff.fixed(1.0), local_retries=1, local_backoff=Backoff.fixed(0)
)


def _consume(delivery: Delivery, bodies: list[dict[str, Any]], handler: Any) -> InMemoryBroker:
    broker = InMemoryBroker(
        seed=delivery.seed,
        duplicate_rate=delivery.duplicate_rate,
        reorder_window=delivery.reorder_window,
    )
    for body in bodies:
        broker.publish("t", body, key=body["key"])
    Consumer(broker, handler, topics=["t"], group="g", workers=delivery.workers,
             retry=RETRY, max_in_flight=16).run_until_idle(timeout=60)
    return broker


def _state_table(engine: Engine, prefix: str) -> Any:
    return temp_table(
        engine, prefix,
        Column("k", String(16), primary_key=True), Column("state", Text), Column("v", Integer),
    )


def _log_table(engine: Engine, prefix: str) -> Any:
    return temp_table(
        engine, prefix,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("k", String(16), nullable=False),
        Column("v", Integer, nullable=False),
    )


def _logged(engine: Engine, log: Table) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    with engine.connect() as conn:
        for key, version in conn.execute(select(log.c.k, log.c.v).order_by(log.c.id)):
            out[key].append(version)
    return dict(out)


def _final(engine: Engine, table: Table) -> dict[str, tuple[str, int]]:
    with engine.connect() as conn:
        return {k: (state, v) for k, state, v in conn.execute(select(table))}


def test_apply_ends_at_n_with_every_transition_once_and_in_order(
    db: SqlSide, engine: Engine
) -> None:
    @settings(max_examples=_examples(db), deadline=None)
    @given(
        keys=st.integers(1, 3),
        n=st.integers(1, 6),
        delivery=deliveries,
        data=st.data(),
    )
    def check(keys: int, n: int, delivery: Delivery, data: st.DataObject) -> None:
        # Transitions None -> 0 (creation), 0 -> 1, ..., n-1 -> n of every key.
        bodies = [
            {"key": f"k{k}", "expected": None if v == 0 else v - 1, "version": v}
            for k in range(keys) for v in range(n + 1)
        ]
        bodies = data.draw(st.permutations(bodies), label="publish order")
        bodies += data.draw(st.lists(st.sampled_from(bodies), max_size=3), label="republished")
        with _state_table(engine, "pa_state") as table, _log_table(engine, "pa_log") as log:
            guard = db.guard(table, "k", "v")

            def handle(message: Message) -> None:
                body = message.body
                with db.begin() as conn:
                    if guard.apply(conn, body["key"], body["expected"], body["version"],
                                   {"state": f"s{body['version']}"}):
                        db.execute(conn, log.insert().values(k=body["key"], v=body["version"]))

            broker = _consume(delivery, bodies, handle)
            assert_all_acked(broker)
            everything = list(range(n + 1))
            assert _logged(engine, log) == {f"k{k}": everything for k in range(keys)}
            assert _final(engine, table) == {f"k{k}": (f"s{n}", n) for k in range(keys)}

    check()


def test_upsert_latest_never_regresses(db: SqlSide, engine: Engine) -> None:
    @settings(max_examples=_examples(db), deadline=None)
    @given(
        keys=st.integers(1, 3),
        n=st.integers(1, 8),
        delivery=deliveries,
        data=st.data(),
    )
    def check(keys: int, n: int, delivery: Delivery, data: st.DataObject) -> None:
        bodies = [{"key": f"k{k}", "version": v} for k in range(keys) for v in range(1, n + 1)]
        bodies = data.draw(st.permutations(bodies), label="publish order")
        bodies += data.draw(st.lists(st.sampled_from(bodies), max_size=4), label="republished")
        behind: list[tuple[str, int, Any]] = []
        lock = threading.Lock()
        with _state_table(engine, "pl_state") as table, _log_table(engine, "pl_log") as log:
            guard = db.guard(table, "k", "v")

            def handle(message: Message) -> None:
                key, version = message.body["key"], message.body["version"]
                with db.begin() as conn:
                    wrote = guard.upsert_latest(conn, key, version, {"state": f"s{version}"})
                    stored = guard.stored_version(conn, key)
                    if wrote:
                        # Logged under the row lock this write holds until commit, so a
                        # key's log follows the order its writes took effect in.
                        db.execute(conn, log.insert().values(k=key, v=version))
                # After our upsert the row holds our version (we wrote) or a newer one.
                if (stored != version) if wrote else (stored < version):
                    with lock:
                        behind.append((key, version, stored))

            broker = _consume(delivery, bodies, handle)
            assert_all_acked(broker)
            assert behind == []
            for key, written in _logged(engine, log).items():
                assert written == sorted(set(written)), f"{key} regressed or wrote twice"
            assert _final(engine, table) == {f"k{k}": (f"s{n}", n) for k in range(keys)}

    check()


def test_upsert_latest_many_matches_a_model_for_any_batching(db: SqlSide, engine: Engine) -> None:
    @settings(max_examples=_examples(db), deadline=None)
    @given(
        rows=st.lists(
            st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 6)),
            min_size=1, max_size=30,
        ),
        cuts=st.lists(st.integers(0, 30), max_size=4),
    )
    def check(rows: list[tuple[str, int]], cuts: list[int]) -> None:
        bounds = sorted({0, len(rows), *(c for c in cuts if c < len(rows))})
        batches = [rows[a:b] for a, b in itertools.pairwise(bounds)]
        model: dict[str, int] = {}
        with _state_table(engine, "pm_state") as table:
            guard = db.guard(table, "k", "v")
            for batch in batches:
                expected = 0
                newest: dict[str, int] = {}
                for key, version in batch:
                    newest[key] = max(version, newest.get(key, version))
                for key, version in newest.items():
                    if key not in model or version > model[key]:
                        model[key] = version
                        expected += 1
                with db.begin() as conn:
                    written = guard.upsert_latest_many(
                        conn, [{"k": k, "state": f"s{v}", "v": v} for k, v in batch]
                    )
                assert written == expected
            assert _final(engine, table) == {k: (f"s{v}", v) for k, v in model.items()}

    check()
