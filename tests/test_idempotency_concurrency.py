"""Races and crashes: threads and processes on one key, and a process killed between
the business write and the completion.

A lease-based checker (Memory, Redis, SQL) gives exactly-once effects without crashes
and at-least-once across a crash: the crashed owner's lease expires and the message is
processed again. TransactionalSqlChecker commits the dedup row with the business
write, so a crash leaves both or neither: exactly once.
"""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from msgpatterns.errors import InProgress
from msgpatterns.idempotency import (
    Checker,
    CheckerSpec,
    TransactionalSqlChecker,
    checker_from_spec,
    idempotent,
)
from msgpatterns.testing.checker_fixtures import SQL_STORES, STORES, checker_for, store_params

THREAD_STORES = store_params(*STORES)
PROCESS_STORES = store_params("sqlite", "redis", "postgres", "mysql")  # shared by processes
SQL = store_params(*SQL_STORES)
CRASHED = 17


def processes() -> ForkServerContext:
    """Fork children from a server that imported this module once (fast, thread-safe)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def payments(name: str) -> sa.Table:
    return sa.Table(name, sa.MetaData(), sa.Column("order_id", sa.String(50), primary_key=True))


# -- what the child processes run ------------------------------------------------------------

def race_in_process(spec: CheckerSpec, barrier: Any, loser_done: Any, results: Any) -> None:
    """Call the handler for key "k" once, in step with the other racer."""
    checker = checker_from_spec(spec)

    @idempotent(checker, key=lambda key, tx=None: key, group="race")
    def handle(key: str, tx: Any = None) -> str:
        results.put("ran")
        if not checker.passes_tx:
            loser_done.wait(10)  # hold the lease until the other racer has its answer
        return "ran"

    barrier.wait(10)
    try:
        outcome = "returned" if handle("k") == "ran" else "skipped"
    except InProgress:
        outcome = "in_progress"
    if outcome != "returned":
        loser_done.set()
    results.put(outcome)


def crash_in_process(spec: CheckerSpec, effects: str, table: str, when: str) -> None:
    """Apply the effect of key "order-1" and die: before completion (``when="before"``,
    right after the business write) or after it, before the broker ack."""
    checker = checker_from_spec(spec)

    @idempotent(checker, key=lambda key, tx=None: key, group="crash")
    def handle(key: str, tx: Any = None) -> None:
        write_effect(key, tx, effects, table)
        if when == "before":
            os._exit(CRASHED)

    handle("order-1")
    os._exit(CRASHED)  # the handler returned; the process dies before acking


def write_effect(key: str, tx: Any, effects: str, table: str) -> None:
    """The business write: through ``tx`` when there is one, else to a SQLite file."""
    if tx is not None:
        tx.execute(payments(table).insert().values(order_id=key))
        return
    with sqlite3.connect(effects) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS effects (key TEXT)")
        conn.execute("INSERT INTO effects VALUES (?)", (key,))


def count_effects(effects: str) -> int:
    with sqlite3.connect(effects) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS effects (key TEXT)")
        return int(conn.execute("SELECT count(*) FROM effects").fetchone()[0])


# -- fixtures --------------------------------------------------------------------------------

def run_children(target: Callable[..., None], args_list: list[tuple[Any, ...]]) -> list[int]:
    children = [processes().Process(target=target, args=args) for args in args_list]
    for child in children:
        child.start()
    for child in children:
        child.join(30)
    return [child.exitcode if child.exitcode is not None else -1 for child in children]


# -- threads ---------------------------------------------------------------------------------

def _race_threads(checker: Checker, threads: int = 8) -> list[str]:
    barrier = threading.Barrier(threads)
    losers = threading.Semaphore(0)
    outcomes: list[str] = []
    lock = threading.Lock()

    @idempotent(checker, key=lambda key, tx=None: key, group="race")
    def handle(key: str, tx: Any = None) -> str:
        with lock:
            outcomes.append("ran")
        if not checker.passes_tx:  # hold the lease until every other thread has its answer
            for _ in range(threads - 1):
                assert losers.acquire(timeout=10)
        return "ran"

    def racer() -> None:
        barrier.wait(10)
        try:
            outcome = "returned" if handle("k") == "ran" else "skipped"
        except InProgress:
            outcome = "in_progress"
        except Exception as exc:  # pragma: no cover - shown by the assertion
            outcome = repr(exc)
        with lock:
            outcomes.append(outcome)
        if outcome != "returned":
            losers.release()

    workers = [threading.Thread(target=racer) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(30)
    return outcomes


@pytest.mark.parametrize("store", THREAD_STORES)
def test_eight_threads_on_one_key_run_the_handler_once(store: str, tmp_path: Path) -> None:
    with checker_for(store, tmp_path) as checker:
        outcomes = _race_threads(checker)
    assert sorted(outcomes) == ["in_progress"] * 7 + ["ran", "returned"]


@pytest.mark.parametrize("store", SQL)
def test_eight_threads_on_one_key_transactional(store: str, tmp_path: Path) -> None:
    with checker_for(store, tmp_path, transactional=True) as checker:
        outcomes = _race_threads(checker)
    assert sorted(outcomes) == ["ran", "returned"] + ["skipped"] * 7


# -- processes -------------------------------------------------------------------------------

def _race_processes(spec: CheckerSpec) -> list[str]:
    context = processes()
    barrier, loser_done, results = context.Barrier(2), context.Event(), context.Queue()
    codes = run_children(race_in_process, [(spec, barrier, loser_done, results)] * 2)
    assert codes == [0, 0]
    return sorted(results.get(timeout=5) for _ in range(3))


@pytest.mark.parametrize("store", PROCESS_STORES)
def test_two_processes_on_one_key_run_the_handler_once(
    store: str, tmp_path: Path,
) -> None:
    with checker_for(store, tmp_path) as checker:
        assert _race_processes(checker.spec()) == ["in_progress", "ran", "returned"]


@pytest.mark.parametrize("store", SQL)
def test_two_processes_on_one_key_transactional(store: str, tmp_path: Path) -> None:
    with checker_for(store, tmp_path, transactional=True) as checker:
        assert _race_processes(checker.spec()) == ["ran", "returned", "skipped"]


# -- crashes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("store", PROCESS_STORES)
def test_crash_before_completion_with_a_lease_is_at_least_once_never_lost(
    store: str, tmp_path: Path,
) -> None:
    effects = str(tmp_path / "effects.db")
    # The lease outlasts the child's exit even on a loaded machine (a 0.5 s one did not).
    with checker_for(store, tmp_path, lease=3.0) as checker:
        assert run_children(crash_in_process, [(checker.spec(), effects, "", "before")]) \
            == [CRASHED]
        assert count_effects(effects) == 1  # the effect happened, completion did not

        @idempotent(checker, key=lambda key: key, group="crash")
        def redelivered(key: str) -> None:
            write_effect(key, None, effects, "")

        with pytest.raises(InProgress) as early:  # the dead owner's lease still runs
            redelivered("order-1")
        assert early.value.delay is not None and 0 < early.value.delay <= 3.0
        time.sleep(early.value.delay + 0.05)  # the redelivery delay InProgress asked for
        redelivered("order-1")
        redelivered("order-1")
    assert count_effects(effects) == 2  # processed again: at least once, never lost


@pytest.mark.parametrize("store", PROCESS_STORES)
def test_crash_after_completion_before_the_ack_skips_the_redelivery(
    store: str, tmp_path: Path,
) -> None:
    effects = str(tmp_path / "effects.db")
    with checker_for(store, tmp_path) as checker:
        assert run_children(crash_in_process, [(checker.spec(), effects, "", "after")]) \
            == [CRASHED]

        @idempotent(checker, key=lambda key: key, group="crash")
        def redelivered(key: str) -> None:
            write_effect(key, None, effects, "")

        assert redelivered("order-1") is None
    assert count_effects(effects) == 1


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("store", SQL)
def test_crash_with_the_transactional_checker_applies_the_effect_exactly_once(
    store: str, when: str, tmp_path: Path, unique: str,
) -> None:
    with checker_for(store, tmp_path, transactional=True) as checker:
        assert isinstance(checker, TransactionalSqlChecker)
        table = payments(f"payments_{unique}")
        table.create(checker.engine)
        try:
            assert run_children(crash_in_process, [(checker.spec(), "", table.name, when)]) \
                == [CRASHED]

            def paid() -> list[str]:
                with checker.engine.connect() as conn:
                    return list(conn.scalars(sa.select(table.c.order_id)))

            assert paid() == ([] if when == "before" else ["order-1"])

            @idempotent(checker, key=lambda key, tx=None: key, group="crash")
            def redelivered(key: str, tx: Any = None) -> None:
                write_effect(key, tx, "", table.name)

            redelivered("order-1")
            redelivered("order-1")
            assert paid() == ["order-1"]
        finally:
            table.drop(checker.engine)


@pytest.mark.parametrize("store", store_params("sqlite", "redis"))
def test_crash_with_a_completion_still_queued_by_write_behind_is_at_least_once(
    store: str, tmp_path: Path,
) -> None:
    effects = str(tmp_path / "effects.db")
    with checker_for(store, tmp_path, lease=0.5, write_behind=0.4) as checker:
        assert run_children(crash_in_process, [(checker.spec(), effects, "", "after")]) \
            == [CRASHED]  # the handler returned; its completion was only queued

        @idempotent(checker, key=lambda key: key, group="crash")
        def redelivered(key: str) -> None:
            write_effect(key, None, effects, "")

        with pytest.raises(InProgress) as early:
            redelivered("order-1")
        assert early.value.delay is not None
        time.sleep(early.value.delay + 0.05)
        redelivered("order-1")
    assert count_effects(effects) == 2  # the queued completion died with the process
