"""What only the async batching helpers have (issue 12 item 4): ``async def``
processors and the refusal of the wrong kind, worker tasks, ``async with``,
flush/aclose from the processor, cancellation. The rules of DESIGN 6 they share with
BatchExecutor, Flusher and MultipleQueueFlusher run on both APIs, one body each, in
tests/test_batching_core.py and tests/test_batching_policies.py."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest

from msgpatterns import BatchExecutor, Flusher, Message, MultipleQueueFlusher
from msgpatterns.aio import AsyncBatchExecutor, AsyncFlusher, AsyncMultipleQueueFlusher
from msgpatterns.errors import ConfigurationError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

LONG = 3600.0  # a flush interval no test waits for
GUARD = 20.0  # only bounds a hang if the code under test is broken


def settled_into(outcomes: dict[str, BaseException | None], key: str) -> Message:
    """A message acked by hand whose outcome (None or the error) lands in ``outcomes``."""
    message = Message(key.encode(), key=key)
    message.disable_auto_ack()
    message.bind(lambda m, error: outcomes.__setitem__(str(m.key), error))
    return message


# -- refused at construction ------------------------------------------------------------


async def sync_write(batch: Any) -> None:
    return None


def quiet(batch: Any) -> None:
    return None


@pytest.mark.parametrize(("make", "name"), [
    (lambda: AsyncBatchExecutor("x", 10, quiet), "msgpatterns.BatchExecutor"),
    (lambda: AsyncFlusher("x", 10, LONG, 100, quiet), "msgpatterns.Flusher"),
    (lambda: AsyncMultipleQueueFlusher("x", 3, 100, 10, LONG, int, quiet),
     "msgpatterns.MultipleQueueFlusher"),
    (lambda: BatchExecutor("x", 10, sync_write), "msgpatterns.aio.AsyncBatchExecutor"),
    (lambda: Flusher("x", 10, LONG, 100, 1, sync_write), "msgpatterns.aio.AsyncFlusher"),
    (lambda: MultipleQueueFlusher("x", 3, 100, 10, LONG, 1, int, sync_write),
     "msgpatterns.aio.AsyncMultipleQueueFlusher"),
])
async def test_the_wrong_kind_of_processor_is_refused_naming_the_right_class(
    make: Callable[[], object], name: str
) -> None:
    with pytest.raises(TypeError, match=name.replace(".", r"\.") + r"\b"):
        make()


@pytest.mark.parametrize(("factory", "argument"), [
    (lambda: AsyncBatchExecutor("x", 0, sync_write), "batch_size"),
    (lambda: AsyncBatchExecutor("x", 10, sync_write, workers=0), "workers"),
    (lambda: AsyncBatchExecutor("x", 10, sync_write, queue_size=5), "queue_size"),
    (lambda: AsyncFlusher("x", 10, 0, 100, sync_write), "flush_interval"),
    (lambda: AsyncFlusher("x", 10, -1.0, 100, sync_write), "flush_interval"),
    (lambda: AsyncFlusher("x", 10, 0.1, 100, "not a function"), "processor"),
    (lambda: AsyncMultipleQueueFlusher("x", 0, 100, 10, 0.1, int, sync_write), "channels"),
])
async def test_bad_configuration_is_refused(factory: Callable[[], object], argument: str) -> None:
    with pytest.raises(ConfigurationError, match=argument):
        factory()


async def test_an_async_route_is_refused() -> None:
    async def route(item: Any) -> int:
        return 0

    with pytest.raises(TypeError, match="route"):
        AsyncMultipleQueueFlusher("x", 2, 10, 5, 0.1, route, sync_write)  # type: ignore[arg-type]


# -- only on the async driver -------------------------------------------------------------


async def test_async_with_drains_and_names_its_worker_tasks() -> None:
    done: list[int] = []
    names: set[str] = set()

    async def write(batch: list[int]) -> None:
        task = asyncio.current_task()
        assert task is not None
        names.add(task.get_name())
        done.extend(batch)

    async with AsyncFlusher("orders-sink", 10, LONG, 100, write, workers=3) as flusher:
        for i in range(25):
            assert await flusher.add(i)
    assert sorted(done) == list(range(25))
    assert names <= {"orders-sink-0", "orders-sink-1", "orders-sink-2"}
    assert flusher.closed
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("orders-sink-")]


@pytest.mark.parametrize("method", ["flush", "aclose"])
async def test_flush_or_aclose_from_the_processor_refuses_to_deadlock(method: str) -> None:
    refused: list[BaseException] = []
    helper: AsyncBatchExecutor[int]

    async def write(batch: list[int]) -> None:
        try:
            await getattr(helper, method)()
        except RuntimeError as exc:
            refused.append(exc)

    helper = AsyncBatchExecutor("x", 10, write)
    await helper.add(1)
    assert await helper.aclose(GUARD)
    assert len(refused) == 1


async def test_a_cancelled_error_from_the_processor_fails_its_batch_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    done: list[int] = []

    async def write(batch: list[int]) -> None:
        if 0 in batch:
            raise asyncio.CancelledError  # e.g. an inner timeout gone wrong
        done.extend(batch)

    with caplog.at_level(logging.ERROR, logger="msgpatterns.batching"):
        executor = AsyncBatchExecutor("x", 10, write)
        await executor.add(0)
        await executor.flush()
        await executor.add(1)
        assert await executor.aclose()
    assert done == [1]
    assert executor.counters.errors == 1
    assert "processor failed" in caplog.text


async def test_a_cancelled_worker_settles_its_running_batch_then_ends() -> None:
    """Cancelling the worker tasks (a loop shutting down) must not strand the running
    batch's messages unsettled: they are acked with the error (so redelivered)."""
    outcomes: dict[str, BaseException | None] = {}
    entered = asyncio.Event()

    async def write(batch: list[Message]) -> None:
        entered.set()
        await asyncio.Event().wait()  # forever, until cancelled

    msg = settled_into(outcomes, "m")
    executor = AsyncBatchExecutor("x", 10, write, ack_messages=True)
    await executor.add(msg)
    await asyncio.wait_for(entered.wait(), GUARD)
    workers = [t for t in asyncio.all_tasks() if t.get_name() == "x-0"]
    for task in workers:
        task.cancel()
    await asyncio.wait(workers)
    assert all(task.cancelled() for task in workers)
    assert isinstance(outcomes["m"], asyncio.CancelledError)
    assert executor.counters.depth == 0
    assert await executor.aclose(GUARD)


async def test_a_batch_is_full_at_once_and_the_rest_waits_for_the_interval() -> None:
    batches: list[list[int]] = []
    full = asyncio.Event()

    async def write(batch: list[int]) -> None:
        batches.append(batch)
        full.set()

    flusher = AsyncFlusher("x", 3, LONG, 10, write)
    for i in range(4):
        await flusher.add(i)
    await asyncio.wait_for(full.wait(), GUARD)
    assert batches == [[0, 1, 2]], "a full batch goes out without waiting"
    assert await flusher.aclose()
    assert batches == [[0, 1, 2], [3]]


async def test_a_processor_may_await_io_while_other_workers_run() -> None:
    """Worker tasks overlap while each awaits: ``workers`` batches in flight at once."""
    inside = 0
    most = 0
    all_in = asyncio.Event()

    async def write(batch: list[int]) -> None:
        nonlocal inside, most
        inside += 1
        most = max(most, inside)
        if inside == 3:
            all_in.set()
        await asyncio.wait_for(all_in.wait(), GUARD)
        inside -= 1

    executor = AsyncBatchExecutor("x", 1, write, workers=3)
    for i in range(3):
        await executor.add(i)
    assert await executor.aclose()
    assert most == 3

