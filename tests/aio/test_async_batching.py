"""Batching's rules, sync and async (issue 12 item 4): every rule of DESIGN 6 checked on
BatchExecutor, Flusher and MultipleQueueFlusher and on their async twins (worker tasks,
``async def`` processors), plus what only the async driver has (awaitable ``add``,
``aclose``, ``async with``, cancellation)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any, Literal

import pytest

from msgpatterns import BatchExecutor, Flusher, Group, Message, MultipleQueueFlusher
from msgpatterns.aio import AsyncBatchExecutor, AsyncFlusher, AsyncMultipleQueueFlusher
from msgpatterns.errors import ConfigurationError, QueueClosed

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

Mode = Literal["sync", "async"]
Kind = Literal["executor", "flusher", "multiple"]
MODES: list[Mode] = ["sync", "async"]
KINDS: list[Kind] = ["executor", "flusher", "multiple"]
CHANNELS = 3
LONG = 3600.0  # a flush interval no test waits for
GUARD = 20.0  # only bounds a hang if the code under test is broken

SYNC = {"executor": BatchExecutor, "flusher": Flusher, "multiple": MultipleQueueFlusher}
ASYNC = {"executor": AsyncBatchExecutor, "flusher": AsyncFlusher,
         "multiple": AsyncMultipleQueueFlusher}


def items_of(batch: Any) -> list[Any]:
    return list(batch.items) if isinstance(batch, Group) else list(batch)


class Gate:
    """Opened from the test (the loop's thread); waited on by a sync processor (in its
    worker thread) or an async one (on the loop)."""

    def __init__(self, opened: bool = True) -> None:
        self.thread = threading.Event()
        self.loop = asyncio.Event()
        if opened:
            self.open()

    def open(self) -> None:
        self.thread.set()
        self.loop.set()


class Recorder:
    """A processor for either driver recording its batches; ``gate`` holds it."""

    def __init__(self, *, gated: bool = False, fail_first: int = 0) -> None:
        self.lock = threading.Lock()
        self.batches: list[list[Any]] = []
        self.gate = Gate(opened=not gated)
        self.fail_first = fail_first
        self.recorded = threading.Event()  # set by the first batch recorded

    def record(self, batch: Any) -> None:
        with self.lock:
            failing = self.fail_first > 0
            self.fail_first -= 1
            if failing:
                raise RuntimeError("processor failed on purpose")
            self.batches.append(items_of(batch))
        self.recorded.set()

    def sync(self, batch: Any) -> None:
        assert self.gate.thread.wait(GUARD), "gate never opened"
        self.record(batch)

    async def aio(self, batch: Any) -> None:
        await asyncio.wait_for(self.gate.loop.wait(), GUARD)
        self.record(batch)

    def items(self) -> list[Any]:
        with self.lock:
            return [item for batch in self.batches for item in batch]


class Helper:
    """One helper of ``kind`` on the ``mode`` driver, behind awaitable calls (the sync
    helper's blocking calls run in a thread, so the loop can open gates meanwhile)."""

    def __init__(
        self, mode: Mode, kind: Kind, processor: Callable[[Any], Any], *,
        name: str = "batcher", batch_size: int = 10, queue_size: int = 100,
        workers: int = 2, flush_interval: float = LONG, ack_messages: bool = False,
        on_error: Callable[[BaseException, Any], object] | None = None,
        route: Callable[[Any], int] = lambda item: hash(item) % CHANNELS,
    ) -> None:
        self.mode = mode
        options: dict[str, Any] = {
            "name": name, "batch_size": batch_size, "queue_size": queue_size,
            "processor": processor, "ack_messages": ack_messages, "on_error": on_error,
            "threads" if mode == "sync" else "workers": workers,
        }
        if kind != "executor":
            options["flush_interval"] = flush_interval
        if kind == "multiple":
            options.update(channels=CHANNELS, route=route)
        self.helper = (SYNC if mode == "sync" else ASYNC)[kind](**options)

    async def add(self, item: Any, timeout: float | None = None) -> bool:
        if self.mode == "async":
            return bool(await self.helper.add(item, timeout))
        if timeout:
            return bool(await asyncio.to_thread(self.helper.add, item, timeout))
        return bool(self.helper.add(item))

    async def fill(self, items: range) -> int:
        """Add without waiting until one is refused; how many were accepted."""
        accepted = 0
        for item in items:
            if not await self.add(item):
                break
            accepted += 1
        return accepted

    async def flush(self, timeout: float | None = None) -> bool:
        if self.mode == "async":
            return bool(await self.helper.flush(timeout))
        return bool(await asyncio.to_thread(self.helper.flush, timeout))

    async def close(self, timeout: float | None = None) -> bool:
        if self.mode == "async":
            return bool(await self.helper.aclose(timeout))
        return bool(await asyncio.to_thread(self.helper.close, timeout))

    @property
    def counters(self) -> Any:
        return self.helper.counters


def settled_into(outcomes: dict[str, BaseException | None], key: str) -> Message:
    """A message acked by hand whose outcome (None or the error) lands in ``outcomes``."""
    message = Message(key.encode(), key=key)
    message.disable_auto_ack()
    message.bind(lambda m, error: outcomes.__setitem__(str(m.key), error))
    return message


def make(mode: Mode, kind: Kind, recorder: Recorder, **options: Any) -> Helper:
    return Helper(mode, kind, recorder.sync if mode == "sync" else recorder.aio, **options)


both = pytest.mark.parametrize("mode", MODES)
every_kind = pytest.mark.parametrize("kind", KINDS)


# -- the rules, on both drivers ---------------------------------------------------------


@both
@every_kind
async def test_a_processor_exception_does_not_kill_the_worker(mode: Mode, kind: Kind) -> None:
    recorder = Recorder(fail_first=1)
    failures: list[tuple[BaseException, list[Any]]] = []
    helper = make(mode, kind, recorder, workers=1,
                  on_error=lambda exc, batch: failures.append((exc, items_of(batch))))
    for i in range(3):
        assert await helper.add(i)
    assert await helper.flush(GUARD)
    for i in range(3, 20):
        assert await helper.add(i)
    assert await helper.close(GUARD)
    failed = [item for _, batch in failures for item in batch]
    assert [type(exc) for exc, _ in failures] == [RuntimeError]
    assert sorted(failed + recorder.items()) == list(range(20))
    assert set(range(3, 20)) <= set(recorder.items()), "batches after the failure were lost"
    assert (helper.counters.errors, helper.counters.processed, helper.counters.depth) == (1, 20, 0)


@both
@every_kind
async def test_close_after_four_producers_processes_every_item_exactly_once(
    mode: Mode, kind: Kind
) -> None:
    recorder = Recorder()
    helper = make(mode, kind, recorder, batch_size=50, queue_size=120)

    async def produce(first: int) -> list[int]:
        return [i for i in range(first, first + 500) if not await helper.add(i, GUARD)]

    refused = await asyncio.gather(*(produce(p * 500) for p in range(4)))
    assert await helper.close()
    assert refused == [[], [], [], []]
    seen = Counter(recorder.items())
    assert set(seen) == set(range(2000))
    assert max(seen.values()) == 1, "an item was processed twice"
    assert all(1 <= len(batch) <= 50 for batch in recorder.batches)
    counters = helper.counters
    assert (counters.items, counters.processed, counters.depth) == (2000, 2000, 0)
    assert counters.batches == len(recorder.batches)


@both
@every_kind
async def test_add_after_close_raises_and_accepts_nothing(mode: Mode, kind: Kind) -> None:
    recorder = Recorder()
    helper = make(mode, kind, recorder)
    assert await helper.add(1)
    assert await helper.close()
    with pytest.raises(QueueClosed):
        await helper.add(2)
    with pytest.raises(QueueClosed):
        await helper.add(3, timeout=1.0)
    assert recorder.items() == [1]
    assert helper.counters.items == 1
    assert helper.helper.closed


@both
@every_kind
async def test_capacity_with_a_blocked_processor_is_exactly_queue_size(
    mode: Mode, kind: Kind
) -> None:
    recorder = Recorder(gated=True)
    helper = make(mode, kind, recorder, batch_size=7, queue_size=50, route=lambda item: 1)
    assert await helper.fill(range(1000)) == 50
    assert await helper.add("late", timeout=0.01) is False
    counters = helper.counters
    assert (counters.items, counters.depth, counters.rejected) == (50, 50, 2)
    recorder.gate.open()
    assert await helper.close()
    assert sorted(recorder.items()) == list(range(50))


async def full_and_blocked(mode: Mode, kind: Kind) -> tuple[Recorder, Helper]:
    """A helper holding its capacity (items 0..4) with its only worker blocked."""
    recorder = Recorder(gated=True)
    helper = make(mode, kind, recorder, batch_size=5, queue_size=5, workers=1,
                  route=lambda item: 1)  # one channel holds everything
    assert await helper.fill(range(5)) == 5
    return recorder, helper


@both
@every_kind
async def test_add_with_timeout_waits_for_room(mode: Mode, kind: Kind) -> None:
    recorder, helper = await full_and_blocked(mode, kind)
    waiting = asyncio.ensure_future(helper.add(99, timeout=GUARD))
    await asyncio.sleep(0)
    recorder.gate.open()  # the blocked batch finishes: room for the waiting producer
    assert await waiting is True
    assert await helper.close()
    assert sorted(recorder.items()) == [0, 1, 2, 3, 4, 99]


@both
@every_kind
async def test_a_producer_waiting_for_room_gets_queue_closed(mode: Mode, kind: Kind) -> None:
    recorder, helper = await full_and_blocked(mode, kind)
    producer = asyncio.ensure_future(helper.add(99, timeout=GUARD))
    closing = asyncio.ensure_future(helper.close())
    with pytest.raises(QueueClosed):  # full while closing, or closed already
        await producer
    recorder.gate.open()
    assert await closing
    assert sorted(recorder.items()) == [0, 1, 2, 3, 4]


@both
@every_kind
async def test_flush_forces_pending_items_out_and_waits_for_them(mode: Mode, kind: Kind) -> None:
    recorder = Recorder()
    helper = make(mode, kind, recorder, batch_size=100)
    for i in range(5):
        assert await helper.add(i)
    assert await helper.flush()
    assert sorted(recorder.items()) == [0, 1, 2, 3, 4]
    assert helper.counters.depth == 0
    assert await helper.flush(), "flushing an empty queue returns at once"
    assert await helper.close()


@both
async def test_a_flusher_holds_a_partial_batch_until_flushed(mode: Mode) -> None:
    recorder = Recorder()
    helper = make(mode, "flusher", recorder, batch_size=100, workers=1)
    for i in range(5):
        await helper.add(i)
    await asyncio.sleep(0)
    assert recorder.batches == [], "nothing is due before the interval or a flush"
    await helper.flush()
    assert recorder.batches == [[0, 1, 2, 3, 4]]
    assert await helper.close()


@both
@pytest.mark.parametrize("kind", ["flusher", "multiple"])
async def test_a_lone_item_goes_out_when_its_interval_runs_out(mode: Mode, kind: Kind) -> None:
    recorder = Recorder()
    helper = make(mode, kind, recorder, batch_size=100, flush_interval=0.02)
    await helper.add("lonely")
    assert await asyncio.to_thread(recorder.recorded.wait, GUARD)  # no flush, no close
    assert recorder.items() == ["lonely"]
    assert await helper.close()


@both
@every_kind
async def test_close_with_timeout_returns_false_then_drains(mode: Mode, kind: Kind) -> None:
    recorder = Recorder(gated=True)
    helper = make(mode, kind, recorder, name="draining", batch_size=2, workers=1)
    for i in range(5):
        assert await helper.add(i)
    assert await helper.close(timeout=0.05) is False, "the processor is blocked"
    with pytest.raises(QueueClosed):
        await helper.add(5)
    recorder.gate.open()
    assert await helper.close() is True
    assert sorted(recorder.items()) == [0, 1, 2, 3, 4]


@both
@every_kind
async def test_counters(mode: Mode, kind: Kind) -> None:
    recorder = Recorder(gated=True, fail_first=1)
    helper = make(mode, kind, recorder, batch_size=2, queue_size=4, workers=1,
                  route=lambda i: 0)
    assert await helper.fill(range(10)) == 4
    assert helper.counters.as_dict() == {
        "items": 4, "processed": 0, "batches": 0, "rejected": 1, "errors": 0, "depth": 4,
    }
    recorder.gate.open()
    assert await helper.close()
    counters = helper.counters
    assert (counters.items, counters.processed, counters.rejected) == (4, 4, 1)
    assert (counters.errors, counters.depth) == (1, 0)
    assert counters.batches == len(recorder.batches) + 1  # the failed one counts too


@both
@every_kind
async def test_ack_messages_acks_after_success_and_with_the_error_after_failure(
    mode: Mode, kind: Kind
) -> None:
    outcomes: dict[str, BaseException | None] = {}
    failure = RuntimeError("bulk insert failed")
    self_acked = settled_into(outcomes, "self-acked")

    def write(batch: Any) -> None:
        if self_acked in items_of(batch):
            self_acked.ack()  # the processor settles this one itself
        if any(m.key == "bad" for m in items_of(batch)):
            raise failure

    async def awrite(batch: Any) -> None:
        await asyncio.sleep(0)
        write(batch)

    helper = Helper(mode, kind, write if mode == "sync" else awrite, workers=1,
                    ack_messages=True, route=lambda m: 0)
    for key in ("a", "b"):
        await helper.add(settled_into(outcomes, key))
    await helper.flush()
    await helper.add(settled_into(outcomes, "bad"))
    await helper.add(self_acked)
    with pytest.raises(TypeError, match="must be a Message"):
        await helper.add("not a message")  # it could never be acked: refused, not ignored
    assert await helper.close()
    assert outcomes == {"a": None, "b": None, "bad": failure, "self-acked": None}


# -- refused at construction ------------------------------------------------------------


async def sync_write(batch: Any) -> None:
    return None


@pytest.mark.parametrize(("kind", "sync_name"), [
    ("executor", "msgpatterns.BatchExecutor"), ("flusher", "msgpatterns.Flusher"),
    ("multiple", "msgpatterns.MultipleQueueFlusher"),
])
async def test_a_sync_processor_is_refused_naming_the_sync_class(
    kind: Kind, sync_name: str
) -> None:
    with pytest.raises(TypeError, match=sync_name.replace(".", r"\.")):
        Helper("async", kind, lambda batch: None)
    with pytest.raises(TypeError, match=f"msgpatterns\\.aio\\.Async{sync_name.split('.')[1]}"):
        Helper("sync", kind, sync_write)


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

