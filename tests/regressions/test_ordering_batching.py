"""The ordering and batching helpers, regressions written from the outside (first
collected in issue 10): the user's order of calls and the wrong kinds of arguments."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import pytest
import tenacity
from sqlalchemy import Column, Engine, Integer, MetaData, String, Table, select
from sqlalchemy.orm import Session

from msgpatterns import (
    Backoff,
    BatchExecutor,
    Flusher,
    Group,
    Message,
    MultipleQueueFlusher,
    OrderedExecutor,
    optimistic_update,
)
from msgpatterns.errors import ConfigurationError, MalformedMessage
from msgpatterns.ordering.version_guard import VersionGuard
from ordering_db import engine_for, temp_table

# -- callables of the wrong kind ----------------------------------------------------------


async def async_processor(batch: Any) -> None:
    """A coroutine function: calling it only creates a coroutine."""


class AsyncCallable:
    async def __call__(self, batch: Any) -> None:
        """An object whose __call__ is a coroutine function."""


async def _async_two(batch: Any, extra: int) -> None:
    """Made one-argument with functools.partial."""


ASYNC_CALLABLES: list[Any] = [
    pytest.param(async_processor, id="async-def"),
    pytest.param(AsyncCallable(), id="async-callable-object"),
    pytest.param(functools.partial(_async_two, extra=1), id="partial-of-async"),
]


def _build(kind: str, processor: Any = print, route: Any = int, **options: Any) -> Any:
    """One of the three batching helpers with small, valid settings."""
    settings: dict[str, Any] = {
        "batch_size": 1, "threads": 1, "queue_size": 100, "flush_interval": 0.05,
        "channels": 2, **options,
    }
    if kind == "executor":
        return BatchExecutor(
            "reg-x", settings["batch_size"], processor, threads=settings["threads"],
            queue_size=settings["queue_size"], ack_messages=settings.get("ack", False),
            on_error=settings.get("on_error"),
        )
    if kind == "flusher":
        return Flusher(
            "reg-f", settings["batch_size"], settings["flush_interval"],
            settings["queue_size"], settings["threads"], processor,
            ack_messages=settings.get("ack", False), on_error=settings.get("on_error"),
        )
    return MultipleQueueFlusher(
        "reg-m", settings["channels"], settings["queue_size"], settings["batch_size"],
        settings["flush_interval"], settings["threads"], route, processor,
        ack_messages=settings.get("ack", False), on_error=settings.get("on_error"),
    )


KINDS = ["executor", "flusher", "multiple"]


def _worker_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("reg-")}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("coroutine_function", ASYNC_CALLABLES)
def test_async_batch_processor_is_refused_at_construction(
    kind: str, coroutine_function: Any
) -> None:
    """Hole 3: an async processor would "succeed" before its body ran (with
    ack_messages, the messages would be acked): refused at construction, no thread
    left behind."""
    before = _worker_threads()
    with pytest.raises(TypeError, match=r"processor .* is an async def"):
        _build(kind, processor=coroutine_function)
    assert _worker_threads() == before


@pytest.mark.parametrize("coroutine_function", ASYNC_CALLABLES)
def test_async_route_is_refused_at_construction(coroutine_function: Any) -> None:
    """Hole 3: MultipleQueueFlusher's route must return a channel index, not a
    coroutine: refused at construction, not at the first add()."""
    with pytest.raises(TypeError, match="route"):
        _build("multiple", route=coroutine_function)


def test_a_route_that_is_not_callable_is_a_configuration_error() -> None:
    """Hole 10: route="shard" is refused at construction, naming the argument."""
    with pytest.raises(ConfigurationError, match="route"):
        _build("multiple", route="shard")


@pytest.mark.parametrize("position", ["load", "merge", "save"])
@pytest.mark.parametrize("coroutine_function", ASYNC_CALLABLES)
def test_optimistic_update_refuses_async_load_merge_or_save(
    position: str, coroutine_function: Any
) -> None:
    """Hole 3: an async save returns a (truthy) coroutine: the compare-and-set would
    look won without running. Refused before anything is loaded."""
    loaded: list[int] = []
    parts: dict[str, Any] = {
        "load": lambda: loaded.append(1) or 1,
        "merge": lambda current: current + 1,
        "save": lambda current, merged: True,
    }
    parts[position] = coroutine_function
    with pytest.raises(TypeError, match=position):
        optimistic_update(parts["load"], parts["merge"], parts["save"])
    assert loaded == []


@pytest.mark.parametrize("coroutine_function", ASYNC_CALLABLES)
def test_optimistic_update_decorator_refuses_async(coroutine_function: Any) -> None:
    """Hole 3: both decorator forms refuse a coroutine function at decoration time."""
    with pytest.raises(TypeError, match="optimistic_update"):
        optimistic_update(coroutine_function)
    with pytest.raises(TypeError, match="optimistic_update"):
        optimistic_update(attempts=2)(coroutine_function)


def test_optimistic_update_accepts_backoff_and_tenacity_waits_and_refuses_others() -> None:
    """Hole 7: ``wait`` takes a msgpatterns Backoff or a tenacity wait, as documented;
    anything else is refused when the update is set up, not after the first lost
    round."""
    for wait in (Backoff.levels([0.0]), tenacity.wait_none(), Backoff.levels([0.0]) +
                 tenacity.wait_none()):
        rounds = iter([False, True])
        assert optimistic_update(lambda: 1, lambda c: c + 1,
                                 lambda c, m, rounds=rounds: next(rounds), wait=wait) == 2
    saved: list[int] = []
    with pytest.raises(ConfigurationError, match="wait"):
        optimistic_update(lambda: 1, lambda c: c, lambda c, m: saved.append(m) or False,
                          wait="fast")  # type: ignore[arg-type]
    assert saved == []
    with pytest.raises(ConfigurationError, match="wait"):
        optimistic_update(wait=0.1)  # type: ignore[call-overload]
    with pytest.raises(ConfigurationError, match="retry_later"):
        optimistic_update(retry_later=timedelta(seconds=-1))
    with pytest.raises(ConfigurationError, match="attempts"):
        optimistic_update(attempts="3")  # type: ignore[call-overload]


# -- batching: wrong items and sizes ----------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_ack_messages_refuses_items_that_are_not_messages(kind: str) -> None:
    """Hole 10: with ack_messages=True an item that is not a Message would never be
    acked: add() refuses it with a TypeError and does not accept it."""
    processed: list[Any] = []
    helper = _build(kind, processor=processed.append, route=lambda item: 0, ack=True)
    with helper:
        with pytest.raises(TypeError, match="Message"):
            helper.add({"order": 1})
        message = Message({"order": 2}, id="m-2")
        assert helper.add(message)
    assert helper.counters.items == 1
    assert message.acked and message.ack_error is None


@pytest.mark.parametrize(
    ("options", "argument"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"batch_size": 2.5}, "batch_size"),
        ({"batch_size": "10"}, "batch_size"),
        ({"threads": 0}, "threads"),
        ({"threads": "2"}, "threads"),
        ({"queue_size": 0}, "queue_size"),
        ({"queue_size": None}, "queue_size"),
        ({"channels": 0}, "channels"),
        ({"flush_interval": -0.5}, "flush_interval"),
        ({"flush_interval": timedelta(seconds=-1)}, "flush_interval"),
        ({"flush_interval": 0}, "flush_interval"),
        ({"flush_interval": "1s"}, "flush_interval"),
    ],
)
@pytest.mark.parametrize("kind", KINDS)
def test_invalid_sizes_and_intervals_are_refused_at_construction(
    kind: str, options: dict[str, Any], argument: str
) -> None:
    """Hole 10 / hole 8: sizes, counts and intervals of the wrong value or kind raise
    ConfigurationError naming the argument, before any thread starts."""
    if argument == "flush_interval" and kind == "executor":
        pytest.skip("BatchExecutor has no flush_interval")
    if argument == "channels" and kind != "multiple":
        pytest.skip("only MultipleQueueFlusher has channels")
    before = _worker_threads()
    with pytest.raises(ConfigurationError, match=argument):
        _build(kind, **options)
    assert _worker_threads() == before


@pytest.mark.parametrize("kind", KINDS)
def test_a_negative_add_timeout_is_refused_even_when_there_is_room(kind: str) -> None:
    """Hole 8: add(item, timeout=-1) / timedelta(-1) is refused at once, not only when
    the queue happens to be full."""
    with _build(kind, processor=lambda batch: None, route=lambda item: 0) as helper:
        for timeout in (-1.0, timedelta(seconds=-1)):
            with pytest.raises(ConfigurationError, match="negative"):
                helper.add("x", timeout=timeout)
        assert helper.counters.items == 0


# -- batching: BaseException in the processor --------------------------------------------


class Custom(BaseException):
    """A BaseException subclass a library might raise."""


BASE_EXCEPTIONS = [SystemExit, KeyboardInterrupt, GeneratorExit, Custom]


def _close_returns(helper: Any) -> bool:
    """close() without a timeout, run aside so a hang fails the test instead of
    blocking it: True when it returned."""
    returned = threading.Event()

    def close() -> None:
        helper.close()
        returned.set()

    threading.Thread(target=close, daemon=True).start()
    return returned.wait(10)  # a hang detector, not a timing threshold


@pytest.mark.parametrize("error", BASE_EXCEPTIONS, ids=lambda e: e.__name__)
@pytest.mark.parametrize("kind", KINDS)
def test_a_processor_raising_base_exception_fails_one_batch_only(
    kind: str, error: type[BaseException]
) -> None:
    """Hole 18: a processor raising SystemExit (KeyboardInterrupt, GeneratorExit, a
    custom BaseException) fails its batch - counted, passed to on_error, its messages
    acked with the error - and the only worker goes on; close() returns."""
    done: list[Any] = []
    failures: list[tuple[BaseException, Any]] = []

    def processor(batch: Any) -> None:
        items = list(batch)
        if any(m.body == 3 for m in items):
            raise error("poison batch")
        done.extend(m.body for m in items)

    helper = _build(kind, processor=processor, route=lambda m: m.body % 2, ack=True,
                    on_error=lambda exc, batch: failures.append((exc, batch)))
    messages = [Message(i, id=f"m-{i}") for i in range(10)]
    for message in messages:
        assert helper.add(message)
    assert _close_returns(helper), "close() hung: a worker died"
    assert sorted(done) == [0, 1, 2, 4, 5, 6, 7, 8, 9]
    counters = helper.counters
    assert (counters.items, counters.processed, counters.batches, counters.errors,
            counters.depth) == (10, 10, 10, 1, 0)
    assert len(failures) == 1 and isinstance(failures[0][0], error)
    assert all(m.acked for m in messages)
    assert isinstance(messages[3].ack_error, error)
    assert all(m.ack_error is None for m in messages if m.body != 3)


def test_an_on_error_hook_raising_base_exception_does_not_kill_the_worker() -> None:
    """Hole 18: the hook raising SystemExit too: still logged and survived."""

    def processor(batch: list[int]) -> None:
        if 0 in batch:
            raise ValueError("first")

    def hook(exc: BaseException, batch: object) -> None:
        raise SystemExit("hook")

    helper = BatchExecutor("reg-hook", 1, processor, threads=1, on_error=hook)
    for item in range(3):
        assert helper.add(item)
    assert _close_returns(helper)
    assert (helper.counters.processed, helper.counters.errors) == (3, 1)


# -- OrderedExecutor: BaseException in a task ---------------------------------------------


@pytest.mark.parametrize("error", BASE_EXCEPTIONS, ids=lambda e: e.__name__)
def test_an_ordered_task_raising_base_exception_keeps_its_lane(
    error: type[BaseException],
) -> None:
    """Hole 18: the future gets the BaseException; the lane runs the key's next task;
    shutdown returns."""
    ran: list[int] = []

    def task(n: int) -> int:
        if n == 1:
            raise error("task")
        ran.append(n)
        return n

    executor = OrderedExecutor(1, logic_partitions=4)
    futures = [executor.submit("k", task, n) for n in range(4)]
    executor.shutdown(wait=True)
    assert isinstance(futures[1].exception(), error)
    assert [f.result() for i, f in enumerate(futures) if i != 1] == [0, 2, 3]
    assert ran == [0, 2, 3]


@pytest.mark.parametrize("error", BASE_EXCEPTIONS, ids=lambda e: e.__name__)
def test_a_done_callback_raising_base_exception_keeps_its_lane(
    error: type[BaseException],
) -> None:
    """Hole 18: a future's done callback runs on the lane thread; one raising a
    BaseException must not kill the lane and strand the key's later tasks."""
    gate = threading.Event()
    executor = OrderedExecutor(1, logic_partitions=4)
    first: Future[bool] = executor.submit("k", gate.wait, 5)

    def callback(future: Future[bool]) -> None:
        raise error("callback")

    first.add_done_callback(callback)
    second = executor.submit("k", lambda: "second")
    gate.set()
    assert second.result(timeout=10) == "second"
    executor.shutdown(wait=True)
    assert first.result() is True


def test_ordered_executor_sizes_are_configuration_errors() -> None:
    """Hole 10: lanes 0, logic_partitions 0 and sizes of the wrong kind are typed
    misuse errors naming the argument."""
    with pytest.raises(ConfigurationError, match="lanes"):
        OrderedExecutor(0)
    with pytest.raises(ConfigurationError, match="logic_partitions"):
        OrderedExecutor(1, logic_partitions=0)
    with pytest.raises(ConfigurationError, match="lanes"):
        OrderedExecutor("2")  # type: ignore[arg-type]
    with OrderedExecutor(1) as executor, pytest.raises(ConfigurationError, match="lanes"):
        executor.resize(0)


# -- VersionGuard: wrong table, columns, connections and keys -----------------------------


@pytest.fixture
def engine(sql_url: str) -> Iterator[Engine]:
    """SQLite, and the real PostgreSQL and MariaDB (marked)."""
    with engine_for(sql_url) as engine:
        yield engine


@pytest.fixture
def orders(engine: Engine) -> Iterator[Table]:
    with temp_table(engine, "reg_orders",
                    Column("id", String(40), primary_key=True),
                    Column("status", String(20)),
                    Column("version", Integer)) as table:
        yield table


def test_version_guard_refuses_a_table_name() -> None:
    """Hole 10: VersionGuard("orders", ...) raised "'str' object has no attribute 'c'":
    now a ConfigurationError naming the table argument and how to get a Table."""
    with pytest.raises(ConfigurationError, match=r"table must be a SQLAlchemy Table"):
        VersionGuard("orders", key="id", version="version")  # type: ignore[arg-type]


def test_version_guard_columns_must_belong_to_the_table(orders: Table) -> None:
    """Hole 10: a Column of another table was silently swapped for this table's column
    of the same name; names are resolved on the table, anything else is refused."""
    other = Table("other", MetaData(), Column("id", String(40), primary_key=True),
                  Column("version", Integer))
    with pytest.raises(ConfigurationError, match=r"key column .* is not a column of table"):
        VersionGuard(orders, key=other.c.id, version="version")
    with pytest.raises(ConfigurationError, match=r"version column .* is not a column of table"):
        VersionGuard(orders, key="id", version=other.c.version)
    with pytest.raises(ConfigurationError, match=r"version: table .* has no column 'ver'"):
        VersionGuard(orders, key="id", version="ver")
    with pytest.raises(ConfigurationError, match="key"):
        VersionGuard(orders, key=42, version="version")  # type: ignore[arg-type]
    guard = VersionGuard(orders, key="id", version="version")  # names are resolved
    assert guard.key_columns == (orders.c.id,) and guard.version_column is orders.c.version


def test_every_guard_method_accepts_an_engine_in_its_own_transaction(
    engine: Engine, orders: Table
) -> None:
    """Hole 10: guard.upsert_latest(engine, ...) raised "'Engine' object has no
    attribute 'execute'". An Engine is accepted by every method: each call runs in its
    own transaction, committed when it returns."""
    guard = VersionGuard(orders, key="id", version="version")
    assert guard.upsert_latest(engine, "a", 2, {"status": "paid"})
    assert not guard.upsert_latest(engine, "a", 1, {"status": "new"})
    assert guard.apply(engine, "b", None, 1, {"status": "new"})
    assert guard.apply(engine, "b", 1, 2, {"status": "paid"})
    assert guard.compare_and_set(engine, "b", 2, 3, {"status": "sent"})
    assert guard.upsert_latest_many(engine, [{"id": "c", "version": 1, "status": "x"}]) == 1
    assert guard.stored_version(engine, "b") == 3
    row = guard.read(engine, "a")
    assert row is not None and row["status"] == "paid"
    with engine.connect() as conn:  # committed: another connection sees them
        stored = {r.id: r.version for r in conn.execute(select(orders.c.id, orders.c.version))}
    assert stored == {"a": 2, "b": 3, "c": 1}


def test_guard_methods_refuse_what_is_neither_connection_nor_engine(
    engine: Engine, orders: Table
) -> None:
    """Hole 10: a Session, a URL or None as the connection: ConfigurationError naming
    the conn argument, for every method."""
    guard = VersionGuard(orders, key="id", version="version")
    calls: dict[str, tuple[Any, ...]] = {
        "upsert_latest": ("a", 1),
        "apply": ("a", None, 1),
        "compare_and_set": ("a", None, 1),
        "upsert_latest_many": ([{"id": "a", "version": 1}],),
        "read": ("a",),
        "stored_version": ("a",),
    }
    with Session(engine) as session:
        for wrong in (session, "sqlite://", None):
            for method, args in calls.items():
                with pytest.raises(ConfigurationError, match="conn must be"):
                    getattr(guard, method)(wrong, *args)


@pytest.mark.parametrize("key", ["", None, b""], ids=repr)
def test_an_empty_or_missing_key_is_refused(engine: Engine, orders: Table, key: Any) -> None:
    """Hole 10: upsert_latest(key="") wrote a row with an empty key; "" and None (also
    through apply and the batch form) are a MalformedMessage naming the key, and
    nothing is written."""
    guard = VersionGuard(orders, key="id", version="version")
    with engine.begin() as conn:
        with pytest.raises(MalformedMessage, match="key"):
            guard.upsert_latest(conn, key, 1, {"status": "x"})
        with pytest.raises(MalformedMessage, match="key"):
            guard.apply(conn, key, None, 1)
        with pytest.raises(MalformedMessage, match="key"):
            guard.upsert_latest_many(conn, [{"id": key, "version": 1}])
        assert conn.execute(select(orders)).all() == []


def test_group_is_still_what_the_multiple_queue_processor_gets() -> None:
    """Hole 10 (no regression): the checks above leave MultipleQueueFlusher's
    processor contract as it was."""
    got: list[Group[int]] = []
    with _build("multiple", processor=got.append, route=lambda n: n % 2) as helper:
        for n in range(4):
            assert helper.add(n)
    assert sorted((g.index, tuple(g.items)) for g in got) == [(0, (0,)), (0, (2,)),
                                                               (1, (1,)), (1, (3,))]
