"""optimistic_update: retries a lost compare-and-set, then asks for a delayed retry.

The rules run on both APIs, one body each: ``optimistic_update`` and
``async_optimistic_update`` (with coroutine ``load`` and ``save``, run on an event
loop) behind :class:`Update`. Sync only: eight threads contending on one row (the
async peer, tasks contending through AsyncVersionGuard, is in
tests/aio/test_async_optimistic.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Column, Engine, Integer, RowMapping

from msgpatterns import NeedRetry, optimistic_update
from msgpatterns.ordering import VersionGuard, async_optimistic_update
from ordering_db import MODES, Mode, engine_for, temp_table


def _coroutine_function(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as an ``async def`` that lets the loop run once before calling it."""
    async def call(*args: Any) -> Any:
        await asyncio.sleep(0)
        return fn(*args)

    return call


class Update:
    """``optimistic_update`` (sync) or ``async_optimistic_update`` (async, each call run
    to completion on an event loop) with the sync one's signatures; ``load``, ``save``
    and decorated functions are given as plain functions and, on the async side,
    handed over as coroutine functions."""

    def __init__(self, mode: Mode) -> None:
        self.mode = mode

    def __call__(self, load: Callable[[], Any], merge: Callable[[Any], Any],
                 save: Callable[[Any, Any], bool], **options: Any) -> Any:
        if self.mode == "sync":
            return optimistic_update(load, merge, save, **options)
        return asyncio.run(async_optimistic_update(
            _coroutine_function(load), merge, _coroutine_function(save), **options))

    def decorate(self, fn: Callable[..., bool] | None = None,
                 **options: Any) -> Any:
        """``@optimistic_update`` on ``fn``, or ``@optimistic_update(**options)`` (then
        a decorator) - the async form on the async side."""
        if self.mode == "sync":
            return optimistic_update(fn) if fn is not None else optimistic_update(**options)
        if fn is None:
            decorator = async_optimistic_update(**options)
            return lambda function: self._blocking(decorator(_coroutine_function(function)))
        return self._blocking(async_optimistic_update(_coroutine_function(fn)))

    @staticmethod
    def _blocking(function: Callable[..., Any]) -> Callable[..., Any]:
        return lambda *args: asyncio.run(function(*args))


@pytest.fixture(params=MODES)
def update(request: pytest.FixtureRequest) -> Update:
    return Update(request.param)


class Cell:
    """A value with a version and a compare-and-set that loses ``losses`` times first."""

    def __init__(self, losses: int = 0) -> None:
        self.value, self.version, self.losses = 0, 0, losses
        self.loads = 0

    def load(self) -> tuple[int, int]:
        self.loads += 1
        return self.value, self.version

    def save(self, current: tuple[int, int], merged: int) -> bool:
        if self.losses > 0:
            self.losses -= 1
            self.version += 1  # someone else wrote in between
            return False
        if current[1] != self.version:
            return False
        self.value, self.version = merged, self.version + 1
        return True


def _plus_one(current: tuple[int, int]) -> int:
    return current[0] + 1


def test_a_lost_compare_and_set_is_retried_with_fresh_data(update: Update) -> None:
    cell = Cell(losses=2)
    assert update(cell.load, _plus_one, cell.save) == 1
    assert cell.loads == 3
    assert (cell.value, cell.version) == (1, 3)


def test_after_attempts_lost_rounds_it_raises_need_retry_with_retry_later(
    update: Update,
) -> None:
    cell = Cell(losses=10)
    with pytest.raises(NeedRetry) as raised:
        update(cell.load, _plus_one, cell.save, attempts=4, retry_later=30.0)
    assert raised.value.delay == 30.0
    assert "4 times" in raised.value.reason
    assert cell.loads == 4
    assert cell.value == 0


def test_errors_are_not_retried(update: Update) -> None:
    cell = Cell()

    def merge(current: tuple[int, int]) -> int:
        raise KeyError("bad payload")

    def load() -> tuple[int, int]:
        raise LookupError("store said no")

    with pytest.raises(KeyError, match="bad payload"):
        update(cell.load, merge, cell.save)
    assert cell.loads == 1
    with pytest.raises(LookupError, match="store said no"):
        update(load, _plus_one, cell.save)
    assert cell.value == 0


def test_as_a_decorator_with_and_without_arguments(update: Update) -> None:
    cell = Cell(losses=2)

    @update.decorate
    def bump(step: int) -> bool:
        return cell.save(cell.load(), cell.value + step)

    assert bump(5) is True
    assert cell.value == 5

    stubborn = Cell(losses=100)

    @update.decorate(attempts=2, retry_later=7)
    def bump_stubborn() -> bool:
        return stubborn.save(stubborn.load(), 1)

    with pytest.raises(NeedRetry) as raised:
        bump_stubborn()
    assert raised.value.delay == 7.0
    assert stubborn.loads == 2


@pytest.mark.parametrize("decorator", [optimistic_update, async_optimistic_update], ids=MODES)
def test_bad_arguments_are_refused(decorator: Any) -> None:
    with pytest.raises(ValueError, match="attempts"):
        decorator(attempts=0)
    with pytest.raises(TypeError, match="load, merge and save"):
        decorator(_coroutine_function(lambda: 1), lambda c: c, None)


@pytest.fixture
def engine(sql_url: str) -> Iterator[Engine]:
    with engine_for(sql_url) as engine:
        yield engine


def test_eight_threads_contending_on_one_row_lose_no_update(engine: Engine) -> None:
    threads, increments = 8, 15
    with temp_table(
        engine, "opt_counter",
        Column("id", Integer, primary_key=True), Column("n", Integer), Column("version", Integer),
    ) as table:
        guard = VersionGuard(table, "id", "version")
        with engine.begin() as conn:
            assert guard.compare_and_set(conn, 1, None, 0, {"n": 0})
        start = threading.Barrier(threads)
        # Every thread's first round loads, then waits until all have loaded: all read
        # the same version, so exactly one save wins and seven lose.
        collide = threading.Barrier(threads)
        lost: list[int] = []
        errors: list[BaseException] = []

        def load() -> RowMapping:
            with engine.connect() as conn:  # a fresh transaction per round
                row = guard.read(conn, 1)
            assert row is not None
            return row

        def save(current: RowMapping, merged: dict[str, Any]) -> bool:
            with engine.begin() as conn:
                version = current["version"]
                if guard.compare_and_set(conn, 1, version, version + 1, merged):
                    return True
            lost.append(version)
            return False

        def work() -> None:
            first = True

            def merge(row: RowMapping) -> dict[str, Any]:
                nonlocal first
                if first:
                    first = False
                    collide.wait()
                return {"n": row["n"] + 1}

            try:
                start.wait()
                for _ in range(increments):
                    while True:  # what redelivery does for a NeedRetry
                        try:
                            optimistic_update(load, merge, save)
                            break
                        except NeedRetry:
                            pass
            except BaseException as exc:
                errors.append(exc)

        workers = [threading.Thread(target=work) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert errors == []
        assert lost.count(0) == threads - 1
        with engine.connect() as conn:
            row = guard.read(conn, 1)
        assert row is not None
        assert row["n"] == threads * increments
        assert row["version"] == threads * increments
