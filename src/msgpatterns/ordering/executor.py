"""OrderedExecutor: per-key FIFO execution with parallelism across keys, resizable.

Guarantees:

* Tasks submitted with the same key run one at a time, in submission order, also
  across :meth:`OrderedExecutor.resize` calls.
* Tasks of different keys run in parallel on up to ``lanes`` threads.
* A task that raises - any ``BaseException``, ``SystemExit`` and ``KeyboardInterrupt``
  included - sets its future's exception; its lane goes on with the next task. A done
  callback that raises is logged; it never stops the lane either.
* ``shutdown(wait=True)`` returns after every task submitted before it has finished.

How: a key maps to a fixed logic partition (a stable hash); each lane (a thread with a
FIFO queue) owns a contiguous range of logic partitions. ``resize`` changes which lane
owns which range. A partition that changes lanes is *held*: its new tasks wait aside,
and a fence (the QMQ "command message") goes to the end of the old lane's queue. When
the old lane reaches the fence, everything it had for that partition has run, and the
held tasks move to the partition's current lane, ahead of anything submitted later.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from types import TracebackType
from typing import Any, ParamSpec, TypeVar

from msgpatterns.errors import ClosedError
from msgpatterns.ordering.partitions import Key, lane_ranges, logic_partition

__all__ = ["OrderedExecutor"]

log = logging.getLogger("msgpatterns.ordering")

P = ParamSpec("P")
T = TypeVar("T")

_Task = tuple["Future[Any]", Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class _Fence:
    """Queued behind a lane's tasks: the lane has drained ``partitions`` when it gets here."""

    __slots__ = ("partitions",)

    def __init__(self, partitions: list[int]) -> None:
        self.partitions = partitions


_RETIRE = object()  # the lane was removed by resize(): exit after its queue so far
_STOP = object()  # the executor shut down and every task has finished: exit


class _Lane:
    __slots__ = ("done", "queue")

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.done = 0  # tasks this lane finished; written by its own thread only


class OrderedExecutor:
    """Run tasks serially per key and in parallel across keys, on ``lanes`` threads.

    Args:
        lanes: worker threads (each owns a contiguous range of logic partitions).
        logic_partitions: fixed number of logic partitions keys hash into; it bounds
            the useful number of lanes and must stay the same for a key to keep its
            place.
        name: prefix of the lane thread names (``{name}-lane-{n}``).

    Use it as a context manager, or call :meth:`shutdown`: lane threads live until then.
    """

    def __init__(
        self, lanes: int, logic_partitions: int = 1024, *, name: str = "msgpatterns-ordered"
    ) -> None:
        lane_ranges(lanes, logic_partitions)  # validates both
        self._partitions = logic_partitions
        self._name = name
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self._threads: list[threading.Thread] = []
        self._lanes: list[_Lane] = []  # current lanes, in range order
        self._live: set[_Lane] = set()  # lanes whose thread has not exited yet
        self._route: list[_Lane] = []  # logic partition -> owning lane
        self._held: dict[int, deque[_Task]] = {}  # partitions waiting for a fence
        self._submitted = 0
        self._finished = 0  # tasks finished by lanes that have exited
        self._closing = False
        self._stopped = False
        with self._lock:
            self._reroute(lanes)

    # -- public API ---------------------------------------------------------------------

    @property
    def lanes(self) -> int:
        """The current number of lanes."""
        return len(self._lanes)

    @property
    def logic_partitions(self) -> int:
        return self._partitions

    @property
    def pending(self) -> int:
        """Tasks submitted and not finished yet (queued, held or running)."""
        with self._lock:
            return self._submitted - self._finished_locked()

    def partition_of(self, key: Key) -> int:
        """The logic partition of ``key`` (stable across processes and resizes)."""
        return logic_partition(key, self._partitions)

    def lane_of(self, key: Key) -> int:
        """The index of the lane that currently owns ``key``."""
        with self._lock:
            return self._lanes.index(self._route[self.partition_of(key)])

    def submit(
        self, key: Key, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> Future[T]:
        """Schedule ``fn(*args, **kwargs)`` after every task submitted earlier with ``key``.

        Returns a :class:`concurrent.futures.Future` with the result or the exception.
        Raises ``RuntimeError`` after :meth:`shutdown`.
        """
        future: Future[T] = Future()
        task: _Task = (future, fn, args, kwargs)
        partition = logic_partition(key, self._partitions)
        with self._lock:
            if self._closing:
                raise ClosedError("cannot submit to an OrderedExecutor after shutdown")
            self._submitted += 1
            held = self._held.get(partition)
            if held is not None:
                held.append(task)
            else:
                self._route[partition].queue.put(task)
        return future

    def resize(self, lanes: int) -> None:
        """Run on ``lanes`` threads from now on; returns without waiting.

        Ranges of logic partitions move between lanes; a moved partition's new tasks
        start only after its old lane has finished the tasks it already had, so each
        key keeps its order.
        """
        lane_ranges(lanes, self._partitions)
        with self._lock:
            if self._closing:
                raise ClosedError("cannot resize an OrderedExecutor after shutdown")
            if lanes != len(self._lanes):
                self._reroute(lanes)

    def shutdown(self, wait: bool = True) -> None:
        """Refuse new tasks; the lanes run every task already submitted, then exit.

        With ``wait`` this returns once all of them have run and the lanes are gone.
        """
        with self._lock:
            if not self._closing:
                self._closing = True
                self._stop_if_done_locked()
            threads = list(self._threads)
        if wait:
            current = threading.current_thread()
            for thread in threads:
                if thread is not current:
                    thread.join()

    def close(self) -> None:
        """``shutdown(wait=True)`` (the lifecycle verb every part has): every task
        already submitted runs, then the lanes exit; idempotent."""
        self.shutdown(wait=True)

    def __enter__(self) -> OrderedExecutor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown(wait=True)

    def __repr__(self) -> str:
        return (
            f"<OrderedExecutor {self._name!r} lanes={self.lanes} "
            f"logic_partitions={self._partitions} pending={self.pending}>"
        )

    # -- routing --------------------------------------------------------------------------

    def _reroute(self, lanes: int) -> None:
        """Switch to ``lanes`` lanes; hold every partition that changes lane until its
        old lane has drained it. Called with the lock held."""
        old = self._lanes
        self._threads = [t for t in self._threads if t.is_alive()]  # forget retired lanes
        new = old[:lanes] + [self._start_lane() for _ in range(len(old), lanes)]
        route: list[_Lane] = []
        for lane, owned in zip(new, lane_ranges(lanes, self._partitions), strict=True):
            route.extend(itertools.repeat(lane, len(owned)))
        fences: dict[_Lane, list[int]] = {}
        for partition, (before, after) in enumerate(itertools.zip_longest(self._route, route)):
            if before is None or before is after or partition in self._held:
                continue  # first routing, unchanged, or already waiting for a fence
            self._held[partition] = deque()
            fences.setdefault(before, []).append(partition)
        self._route = route
        self._lanes = new
        for lane, partitions in fences.items():
            lane.queue.put(_Fence(partitions))
        for lane in old[lanes:]:
            lane.queue.put(_RETIRE)

    def _start_lane(self) -> _Lane:
        lane = _Lane()
        thread = threading.Thread(
            target=self._run_lane, args=(lane,),
            name=f"{self._name}-lane-{next(self._numbers)}", daemon=True,
        )
        self._threads.append(thread)
        self._live.add(lane)
        thread.start()
        return lane

    def _release(self, partitions: Iterable[int]) -> None:
        """A fence was reached: move the held tasks to their partitions' current lanes."""
        with self._lock:
            for partition in partitions:
                put = self._route[partition].queue.put
                for task in self._held.pop(partition):
                    put(task)

    # -- lanes ----------------------------------------------------------------------------

    def _run_lane(self, lane: _Lane) -> None:
        get = lane.queue.get
        while True:
            item = get()
            if type(item) is tuple:
                future, fn, args, kwargs = item
                if future.set_running_or_notify_cancel():
                    _run_task(future, fn, args, kwargs)
                del item, future, fn, args, kwargs
                lane.done += 1
                if self._closing:
                    with self._lock:
                        self._stop_if_done_locked()
            elif isinstance(item, _Fence):
                self._release(item.partitions)
            else:
                with self._lock:
                    self._live.discard(lane)
                    self._finished += lane.done
                    lane.done = 0
                return

    def _finished_locked(self) -> int:
        return self._finished + sum(lane.done for lane in self._live)

    def _stop_if_done_locked(self) -> None:
        if self._stopped or self._submitted != self._finished_locked():
            return
        self._stopped = True
        for lane in self._lanes:
            lane.queue.put(_STOP)


def _run_task(
    future: Future[Any], fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Run one task into its future; nothing it (or a done callback) raises escapes.

    A lane thread has no caller to hand a ``SystemExit`` to, and dying would strand
    every later task of its keys, so any ``BaseException`` goes into the future.
    ``Future`` logs a done callback's ``Exception`` itself; a ``BaseException`` from one
    is logged here.
    """
    try:
        result = fn(*args, **kwargs)
    except BaseException as exc:  # see the docstring
        _complete(future.set_exception, exc)
    else:
        _complete(future.set_result, result)


def _complete(setter: Callable[[Any], None], value: Any) -> None:
    """Complete a future; a done callback raising ``SystemExit`` & co. is logged."""
    try:
        setter(value)
    except BaseException:  # the lane must go on
        log.exception("a done callback of an ordered task raised; the lane goes on")
