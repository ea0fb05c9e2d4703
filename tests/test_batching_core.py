"""DESIGN 6: what BatchExecutor, Flusher and MultipleQueueFlusher share, each "Never"
checked on all three: a worker survives its processor, close drains everything, add
after close raises, capacity is exact; plus flush, close(timeout), counters, acks.

Every test taking ``make`` runs on the sync helpers and on their async twins
(AsyncBatchExecutor, AsyncFlusher, AsyncMultipleQueueFlusher: awaitable ``add``,
``aclose``, ``async with``), one body behind batching_modes' sync face. Sync only:
worker thread names, flush/close called from the processor and the constructors'
checks (their async peers are in tests/aio/test_async_batching.py)."""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

from batching_modes import KINDS, MODES, Batching, Kind, batching, items_of
from msgpatterns import BatchExecutor, Flusher, Message, MultipleQueueFlusher
from msgpatterns.errors import ConfigurationError, QueueClosed

GUARD = 30.0  # only bounds a hang if the code under test is broken


NOT_CALLABLE: Any = "not a function"
Make = Callable[..., Any]
make_sync: Make = Batching("sync").make  # for what only the sync helpers have


@pytest.fixture(params=MODES)
def make(request: pytest.FixtureRequest) -> Iterator[Make]:
    """``make(kind, processor, **options)``: a helper of the sync API or of the async
    one (behind the sync face, see batching_modes)."""
    with batching(request.param) as modes:
        yield modes.make


class Recorder:
    """A processor that records its batches; ``gate`` (when set) blocks it until opened."""

    def __init__(self, *, gated: bool = False, fail_first: int = 0) -> None:
        self.lock = threading.Lock()
        self.batches: list[list[Any]] = []
        self.threads: set[str] = set()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail_first = fail_first
        if not gated:
            self.gate.set()

    def __call__(self, batch: list[Any]) -> None:
        self.entered.set()
        assert self.gate.wait(GUARD), "processor gate never opened"
        with self.lock:
            self.threads.add(threading.current_thread().name)
            failing = self.fail_first > 0
            self.fail_first -= 1
            if failing:
                raise RuntimeError("processor failed on purpose")
            self.batches.append(list(batch))

    def items(self) -> list[Any]:
        with self.lock:
            return [item for batch in self.batches for item in batch]


def fill(helper: Any, items: Iterable[Any]) -> int:
    """Add items without waiting until one is refused; returns how many were accepted."""
    accepted = 0
    for item in items:
        if not helper.add(item):
            break
        accepted += 1
    return accepted


@pytest.mark.parametrize("kind", KINDS)
def test_processor_exception_does_not_kill_the_worker(make: Make, kind: Kind) -> None:
    recorder = Recorder(fail_first=1)
    failures: list[tuple[Exception, list[Any]]] = []
    helper = make(
        kind, recorder, threads=1, on_error=lambda exc, batch: failures.append(
            (exc, items_of(batch))
        ),
    )
    with helper:
        for i in range(3):
            assert helper.add(i)
        assert helper.flush(GUARD)
        for i in range(3, 20):
            assert helper.add(i)
        assert helper.flush(GUARD)
    failed = [item for _, batch in failures for item in batch]
    assert len(failures) == 1
    assert isinstance(failures[0][0], RuntimeError)
    assert sorted(failed + recorder.items()) == list(range(20))
    assert set(range(3, 20)) <= set(recorder.items()), "batches after the failure were lost"
    counters = helper.counters
    assert counters.errors == 1
    assert counters.processed == 20
    assert counters.depth == 0


@pytest.mark.parametrize("kind", KINDS)
def test_close_after_four_producers_processes_every_item_exactly_once(
    make: Make, kind: Kind
) -> None:
    recorder = Recorder()
    helper = make(kind, recorder, batch_size=50, queue_size=300)
    start = threading.Barrier(4)
    refused: list[int] = []

    def produce(first: int) -> None:
        start.wait()
        for item in range(first, first + 2500):
            if not helper.add(item, timeout=GUARD):
                refused.append(item)

    producers = [threading.Thread(target=produce, args=(p * 2500,)) for p in range(4)]
    for thread in producers:
        thread.start()
    for thread in producers:
        thread.join()
    assert helper.close()
    assert not refused
    seen = Counter(recorder.items())
    assert set(seen) == set(range(10_000))
    assert max(seen.values()) == 1, "an item was processed twice"
    assert all(1 <= len(batch) <= 50 for batch in recorder.batches)
    counters = helper.counters
    assert (counters.items, counters.processed, counters.depth) == (10_000, 10_000, 0)
    assert counters.batches == len(recorder.batches)


@pytest.mark.parametrize("kind", KINDS)
def test_add_after_close_raises_and_accepts_nothing(make: Make, kind: Kind) -> None:
    recorder = Recorder()
    helper = make(kind, recorder)
    assert helper.add(1)
    assert helper.close()
    with pytest.raises(QueueClosed):
        helper.add(2)
    with pytest.raises(QueueClosed):
        helper.add(3, timeout=1.0)
    assert recorder.items() == [1]
    assert helper.counters.items == 1
    assert helper.closed


@pytest.mark.parametrize("kind", KINDS)
def test_capacity_with_a_blocked_processor_is_exactly_queue_size(make: Make, kind: Kind) -> None:
    recorder = Recorder(gated=True)
    # Everything to channel 1: MultipleQueueFlusher's queue_size is per channel.
    helper = make(kind, recorder, batch_size=7, queue_size=50, route=lambda item: 1)
    accepted = fill(helper, range(1000))
    assert accepted == 50
    assert helper.add("late", timeout=0.01) is False
    counters = helper.counters
    assert (counters.items, counters.depth, counters.rejected) == (50, 50, 2)
    recorder.gate.set()
    assert helper.close()
    assert sorted(recorder.items()) == list(range(50))


def full_and_blocked(make: Make, kind: Kind) -> tuple[Recorder, Any]:
    """A helper holding its capacity (items 0..4) with its only worker blocked."""
    recorder = Recorder(gated=True)
    helper = make(kind, recorder, batch_size=5, queue_size=5, threads=1,
                  route=lambda item: 1)  # one channel holds everything
    assert fill(helper, range(5)) == 5
    return recorder, helper


@pytest.mark.parametrize("kind", KINDS)
def test_add_with_timeout_waits_for_room(make: Make, kind: Kind) -> None:
    recorder, helper = full_and_blocked(make, kind)
    results: list[bool] = []
    waiter = threading.Thread(target=lambda: results.append(helper.add(99, timeout=GUARD)))
    waiter.start()
    recorder.gate.set()  # the blocked batch finishes: room for the waiting producer
    waiter.join()
    assert results == [True]
    assert helper.close()
    assert sorted(recorder.items()) == [0, 1, 2, 3, 4, 99]


@pytest.mark.parametrize("kind", KINDS)
def test_producer_waiting_for_room_gets_queue_closed(make: Make, kind: Kind) -> None:
    recorder, helper = full_and_blocked(make, kind)
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            helper.add(99, timeout=GUARD)
        except QueueClosed as exc:
            errors.append(exc)

    closing = threading.Thread(target=helper.close)
    closing.start()
    producer = threading.Thread(target=produce)
    producer.start()
    producer.join()  # full while closing, or closed already: QueueClosed either way
    recorder.gate.set()
    closing.join()
    assert len(errors) == 1
    assert sorted(recorder.items()) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("kind", KINDS)
def test_flush_forces_pending_items_out_and_waits_for_them(make: Make, kind: Kind) -> None:
    recorder = Recorder()
    with make(kind, recorder, batch_size=100) as helper:
        for i in range(5):
            assert helper.add(i)
        assert helper.flush()
        assert sorted(recorder.items()) == [0, 1, 2, 3, 4]
        assert helper.counters.depth == 0
        assert helper.flush(), "flushing an empty queue returns at once"


def test_flush_sends_a_partial_flusher_batch_as_one_batch(make: Make) -> None:
    recorder = Recorder()
    with make("flusher", recorder, batch_size=100, threads=1) as helper:
        for i in range(5):
            helper.add(i)
        assert recorder.batches == [], "nothing is due before the interval or a flush"
        helper.flush()
        assert recorder.batches == [[0, 1, 2, 3, 4]]


@pytest.mark.parametrize("kind", KINDS)
def test_close_with_timeout_returns_false_then_drains(make: Make, kind: Kind) -> None:
    recorder = Recorder(gated=True)
    helper = make(kind, recorder, name="draining", batch_size=2, threads=1)
    for i in range(5):
        assert helper.add(i)
    assert helper.close(timeout=0.05) is False, "the processor is blocked"
    with pytest.raises(QueueClosed):
        helper.add(5)
    recorder.gate.set()
    assert helper.close() is True
    assert sorted(recorder.items()) == [0, 1, 2, 3, 4]
    assert not any(t.name.startswith("draining-") for t in threading.enumerate())


@pytest.mark.parametrize("kind", KINDS)
def test_flush_with_timeout_returns_false_while_blocked(make: Make, kind: Kind) -> None:
    recorder = Recorder(gated=True)
    helper = make(kind, recorder)
    helper.add(1)
    assert helper.flush(timeout=0.05) is False
    recorder.gate.set()
    assert helper.flush(GUARD) is True
    helper.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", ["flush", "close"])
def test_flush_or_close_from_the_processor_refuses_to_deadlock(kind: Kind, method: str) -> None:
    refused: list[BaseException] = []
    helper: Any

    def processor(batch: list[Any]) -> None:
        try:
            getattr(helper, method)()
        except RuntimeError as exc:
            refused.append(exc)

    helper = make_sync(kind, processor)
    helper.add(1)
    assert helper.close(GUARD)
    assert len(refused) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_counters(make: Make, kind: Kind) -> None:
    recorder = Recorder(gated=True, fail_first=1)
    helper = make(kind, recorder, batch_size=2, queue_size=4, threads=1, route=lambda i: 0)
    assert fill(helper, range(10)) == 4
    assert helper.counters.as_dict() == {
        "items": 4, "processed": 0, "batches": 0, "rejected": 1, "errors": 0, "depth": 4,
    }
    recorder.gate.set()
    assert helper.close()
    counters = helper.counters
    assert (counters.items, counters.processed, counters.rejected) == (4, 4, 1)
    assert (counters.errors, counters.depth) == (1, 0)
    assert counters.batches == len(recorder.batches) + 1  # the failed one counts too


@pytest.mark.parametrize("kind", KINDS)
def test_worker_threads_are_named_after_the_helper(kind: Kind) -> None:
    recorder = Recorder()
    helper = make_sync(kind, recorder, name="orders-sink", threads=3)
    names = {t.name for t in threading.enumerate() if t.name.startswith("orders-sink-")}
    assert names == {"orders-sink-0", "orders-sink-1", "orders-sink-2"}
    helper.add(1)
    helper.close()
    assert recorder.threads <= names


@pytest.mark.parametrize("kind", KINDS)
def test_ack_messages_acks_after_success_and_with_the_error_after_failure(
    make: Make, kind: Kind, caplog: pytest.LogCaptureFixture
) -> None:
    outcomes: dict[str, BaseException | None] = {}
    failed_keys: set[str] = set()
    failure = RuntimeError("bulk insert failed")

    def message(key: str) -> Message:
        msg = Message(key.encode(), key=key)
        msg.disable_auto_ack()
        msg.bind(lambda m, error: outcomes.__setitem__(str(m.key), error))
        return msg

    self_acked = message("self-acked")

    def processor(batch: list[Any]) -> None:
        if self_acked in batch:
            self_acked.ack()  # the processor settles this one itself
        keys = {str(m.key) for m in batch if isinstance(m, Message)}
        if "bad" in keys:
            failed_keys.update(keys)
            raise failure

    with make(kind, processor, threads=1, ack_messages=True, route=lambda m: 0) as helper:
        for key in ("a", "b", "bad", "c"):
            helper.add(message(key))
        with pytest.raises(TypeError, match="must be a Message"):
            helper.add("not a message")  # it could never be acked: refused, not ignored
        helper.add(self_acked)
    assert set(outcomes) == {"a", "b", "bad", "c", "self-acked"}
    for key, error in outcomes.items():
        if key in failed_keys and key != "self-acked":
            assert error is failure, key
        else:
            assert error is None, key
    assert "bad" in failed_keys
    assert "ignored" not in caplog.text, "a message was acked twice"


def test_on_error_hook_failure_is_logged_and_survived(
    make: Make, caplog: pytest.LogCaptureFixture
) -> None:
    def hook(exc: Exception, batch: Any) -> None:
        raise ValueError("hook is broken too")

    recorder = Recorder(fail_first=1)
    with caplog.at_level(logging.ERROR, logger="msgpatterns.batching"):
        helper = make("flusher", recorder, threads=1, on_error=hook)
        helper.add(1)
        helper.flush()
        helper.add(2)
        assert helper.close()
    assert recorder.items() == [2]
    assert "processor failed" in caplog.text
    assert "on_error hook failed" in caplog.text


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: BatchExecutor("x", 0, print), "batch_size"),
        (lambda: BatchExecutor("x", 10, print, threads=0), "threads"),
        (lambda: BatchExecutor("x", 10, print, queue_size=5), "queue_size"),
        (lambda: Flusher("x", 10, 0, 100, 1, print), "flush_interval"),
        (lambda: Flusher("x", 10, 0.1, 100, 1, NOT_CALLABLE), "processor"),
        (lambda: MultipleQueueFlusher("x", 0, 100, 10, 0.1, 1, int, print), "channels"),
    ],
)
def test_invalid_configuration_is_a_typed_error(
    factory: Callable[[], object], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        factory()
    with pytest.raises(ValueError, match=message):  # ConfigurationError is a ValueError
        factory()


def test_negative_flush_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        Flusher("x", 10, -1.0, 100, 1, print)
