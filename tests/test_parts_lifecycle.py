"""The lifecycle of the parts that are not consumers, from the outside: every checker
(memory, a real Redis, SQLite / PostgreSQL / MariaDB, transactional) and the version
guard (sync and async API from one body) is a context manager; close is idempotent;
after it every operation raises its ``ClosedError`` at once; a close raced from
another thread while the part is in use ends that use with the closed error, never
with another one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, Table, select

from msgpatterns import Message, NeedRetry, idempotent
from msgpatterns.errors import CheckerClosed, ClosedError
from msgpatterns.idempotency import Checker, TransactionalSqlChecker
from msgpatterns.testing.checker_fixtures import SQL_STORES, STORES, checker_for
from ordering_db import MODES, SqlSide, engine_for, orders_table, sql_side

_MARKS = {"redis": [pytest.mark.redis], "postgres": [pytest.mark.postgres],
          "mysql": [pytest.mark.mysql]}
#: Every sync checker kind on every store it runs on: (store, transactional).
ALL_KINDS = [
    *[pytest.param((s, False), marks=_MARKS.get(s, []), id=s) for s in STORES],
    *[pytest.param((s, True), marks=_MARKS.get(s, []), id=f"tx-{s}") for s in SQL_STORES],
]


@pytest.fixture
def any_checker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Checker]:
    store, transactional = request.param
    with checker_for(store, tmp_path, transactional=transactional) as built:
        yield built


def _handler(checker: Checker) -> Any:
    if isinstance(checker, TransactionalSqlChecker):
        @idempotent(checker)
        def handle_tx(message: Message, tx: Any) -> str:
            return "ran"

        return handle_tx

    @idempotent(checker)
    def handle(message: Message) -> str:
        return "ran"

    return handle


@pytest.mark.parametrize("any_checker", ALL_KINDS, indirect=True)
def test_a_checker_is_a_context_manager_closed_once(any_checker: Checker) -> None:
    handle = _handler(any_checker)
    with any_checker as same:
        assert same is any_checker
        assert handle(Message(b"x", id="m-1")) == "ran"
    assert any_checker.closed  # type: ignore[attr-defined]
    any_checker.close()  # idempotent
    with pytest.raises(CheckerClosed, match="closed") as refused:
        handle(Message(b"x", id="m-2"))
    assert isinstance(refused.value, ClosedError)


@pytest.mark.parametrize("any_checker", ALL_KINDS, indirect=True)
def test_a_close_raced_from_another_thread_ends_the_use_with_checker_closed(
        any_checker: Checker) -> None:
    """A thread runs guarded calls in a loop; another closes the checker. Every call
    before the close ran (or, for a call the close cut off mid round trip, asks for a
    retry: the key is never marked DONE without its effect); from the close on, each
    call raises CheckerClosed at once."""
    handle = _handler(any_checker)
    outcomes: list[str] = []
    ended = threading.Event()
    started = threading.Event()

    def use() -> None:
        i = 0
        while True:
            try:
                handle(Message(b"x", id=f"race-{i}"))
                outcomes.append("ran")
            except CheckerClosed:
                outcomes.append("closed")
                ended.set()
                return
            except NeedRetry:
                outcomes.append("retry")
            except BaseException as exc:  # the test reports it
                outcomes.append(f"{type(exc).__name__}: {exc}")
                ended.set()
                return
            i += 1
            if i == 5:
                started.set()

    thread = threading.Thread(target=use, name="test-use", daemon=True)
    thread.start()
    assert started.wait(30)
    closers = [threading.Thread(target=any_checker.close) for _ in range(2)]
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join(30)
    assert ended.wait(30)
    thread.join(30)
    assert outcomes[-1] == "closed"
    assert set(outcomes[:-1]) <= {"ran", "retry"}, outcomes[-3:]
    assert outcomes.count("ran") >= 5


# -- the version guard, sync and async API from one body --------------------------------


@pytest.fixture
def engine(sql_url: str) -> Iterator[Engine]:
    with engine_for(sql_url) as engine:
        yield engine


@pytest.fixture(params=MODES)
def db(request: pytest.FixtureRequest, engine: Engine) -> Iterator[SqlSide]:
    with sql_side(request.param, engine) as side:
        yield side


@pytest.fixture
def orders(engine: Engine) -> Iterator[Table]:
    with orders_table(engine, "life_orders") as table:
        yield table


def _close(db: SqlSide, face: Any) -> None:
    if db.portal is None:
        face.close()
    else:
        db.portal.call(face.guard.aclose)


def test_a_version_guard_closes_once_and_refuses_every_call_afterwards(
        db: SqlSide, orders: Table) -> None:
    face = db.guard(orders, "id", "version")
    guard = face if db.portal is None else face.guard
    if db.portal is None:
        with guard as same:
            assert same is guard
            assert guard.apply(db.bind, "o1", None, 1, {"state": "new"})
    else:
        async def use() -> Any:
            async with guard as same:
                assert same is guard
                return await guard.apply(db.aengine, "o1", None, 1, {"state": "new"})

        assert db.portal.call(use)
    assert guard.closed
    _close(db, face)  # idempotent
    calls = [("read", ("o1",)), ("stored_version", ("o1",)), ("apply", ("o1", 1, 2, {})),
             ("compare_and_set", ("o1", 1, 2, {})), ("upsert_latest", ("o2", 1, {})),
             ("upsert_latest_many", ([{"id": "o3", "version": 1}],))]
    for name, args in calls:
        with pytest.raises(ClosedError, match="closed"):
            getattr(face, name)(db.bind, *args)
    # Nothing was written after the close (o1 stays at version 1, o2 and o3 absent).
    with db.engine.connect() as conn:
        rows = {row.id: row.version for row in conn.execute(select(orders))}
    assert rows == {"o1": 1}


def test_a_closed_version_guard_refuses_before_touching_the_connection(
        db: SqlSide, orders: Table) -> None:
    """After close, a call fails before it opens a transaction: a connection that is
    not one (None) is not even looked at."""
    face = db.guard(orders, "id", "version")
    _close(db, face)
    started = time.monotonic()
    with pytest.raises(ClosedError):
        face.read(None, "o1")
    assert time.monotonic() - started < 5
