"""The one hot-path switch of both drivers: "plain acks, no telemetry listener".

When a consumer starts (and whenever the listener changes) it picks how a message runs
and how a success is settled: the hot path (no telemetry scope; a success is a broker
ack and a freed slot, many acked in one call) or its plain twin (every success through
the settler, reported to the listener). Nothing per message tests it again.

A fast path needs a differential test against its plain twin: the same generated
schedules - handlers that return, fail once, refuse (Reject), ask for a delayed retry,
ack explicitly (with or without an error, during the run or later from another
thread) - run with no listener (the hot path) and with a listener installed (the
twin), on both drivers, plain and ``@idempotent`` (batch claims), ordered or not, and
must settle every message the same way and count the same. And the switch
follows the listener: one installed while the consumer runs sees what is settled after.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from msgpatterns import Backoff, Consumer, InMemoryBroker, Message, NeedRetry, Reject, RetryPolicy
from msgpatterns.aio import AsyncConsumer, AsyncInMemoryBroker
from msgpatterns.idempotency import MemoryChecker, idempotent
from msgpatterns.observability.stats import DeliveryScope, Listener, set_listener

BEHAVIOURS = ("ok", "fail_once", "reject", "retry_later", "explicit", "explicit_error",
              "explicit_later", "explicit_later_error")
RETRY = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(1.0), local_retries=1)
#: The counts both paths keep alike (fetched and released depend on fetch timing).
COMPARED = ("acked", "failed", "retried_locally", "redelivered", "dead_lettered")


class Counting(Listener):
    """Counts what it is told, and opens a (no-op) scope per delivery."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.started = 0
        self._lock = threading.Lock()

    def consumer_counted(self, consumer: Any, counts: Mapping[str, int],
                         message: Message | None = None) -> None:
        with self._lock:
            self.counts.update(counts)

    def delivery_started(self, consumer: Any, message: Message) -> DeliveryScope | None:
        with self._lock:
            self.started += 1
        return DeliveryScope()


@contextmanager
def listening(listener: Listener | None) -> Iterator[None]:
    previous = set_listener(listener)
    try:
        yield
    finally:
        set_listener(previous)


def behave(behaviour: str, message: Message, seen: Counter[str]) -> None:
    """What the handler does with ``message`` (its first run: ``seen`` counts runs)."""
    seen[message.id or ""] += 1
    first = seen[message.id or ""] == 1
    if behaviour == "fail_once" and first:
        raise RuntimeError("once")
    if behaviour == "reject":
        raise Reject("refused")
    if behaviour == "retry_later" and first:
        raise NeedRetry(delay=5.0)
    if behaviour == "explicit":
        message.disable_auto_ack()
        message.ack()
    if behaviour.startswith("explicit_later"):  # acked from another thread, later
        message.disable_auto_ack()
        error = RuntimeError("acked later with an error") \
            if behaviour == "explicit_later_error" and first else None
        threading.Timer(0.005, message.ack, (error,)).start()
    if behaviour == "explicit_error":
        message.disable_auto_ack()
        message.ack(RuntimeError("acked with an error") if first else None)


def outcome(broker: InMemoryBroker, stats: Any) -> tuple[dict[str, str], dict[str, int]]:
    settled = {m.id or "": "acked" for m in broker.acked}
    for letter in broker.dead_letters:
        settled[letter.message.id or ""] = f"dead:{letter.error_type}"
    assert broker.pending == 0
    return settled, {name: getattr(stats, name) for name in COMPARED}


def run_sync(behaviours: list[str], *, guarded: bool, ordered: bool,
             workers: int) -> tuple[dict[str, str], dict[str, int]]:
    broker = InMemoryBroker()
    for i, behaviour in enumerate(behaviours):
        broker.publish("t", behaviour, id=f"m{i}", key=f"k{i}")
    seen: Counter[str] = Counter()

    def handle(message: Message) -> None:
        behave(message.body, message, seen)

    handler: Callable[[Message], None] = handle
    if guarded:
        handler = idempotent(MemoryChecker())(handle)
    consumer = Consumer(broker, handler, topics=["t"], group="g", workers=workers,
                        retry=RETRY, ordered=ordered, fetch_batch=4)
    stats = consumer.run_until_idle(timeout=60)
    return outcome(broker, stats)


def run_async(behaviours: list[str], *, guarded: bool, ordered: bool,
              workers: int) -> tuple[dict[str, str], dict[str, int]]:
    broker = InMemoryBroker()
    for i, behaviour in enumerate(behaviours):
        broker.publish("t", behaviour, id=f"m{i}", key=f"k{i}")
    seen: Counter[str] = Counter()

    async def handle(message: Message) -> None:
        behave(message.body, message, seen)

    handler: Callable[[Message], Any] = handle
    if guarded:
        handler = idempotent(MemoryChecker())(handle)

    async def main() -> Any:
        consumer = AsyncConsumer(AsyncInMemoryBroker(broker), handler, topics=["t"],
                                 group="g", max_in_flight=workers * 4, retry=RETRY,
                                 ordered=ordered, fetch_batch=4)
        return await consumer.run_until_idle(timeout=60)

    return outcome(broker, asyncio.run(main()))


RUNS = {"sync": run_sync, "async": run_async}


@pytest.mark.parametrize("driver", ["sync", "async"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(behaviours=st.lists(st.sampled_from(BEHAVIOURS), min_size=1, max_size=12),
       guarded=st.booleans(), ordered=st.booleans(), workers=st.sampled_from([1, 3]))
def test_the_hot_path_settles_and_counts_as_its_plain_twin(
        driver: str, behaviours: list[str], guarded: bool, ordered: bool,
        workers: int) -> None:
    run = RUNS[driver]
    with listening(None):
        fast = run(behaviours, guarded=guarded, ordered=ordered, workers=workers)
    listener = Counting()
    with listening(listener):
        plain = run(behaviours, guarded=guarded, ordered=ordered, workers=workers)
    assert fast == plain
    # The twin ran: every settlement was reported (exported totals equal the in-process
    # ones); the sync driver also opened a scope per run.
    assert {name: listener.counts[name] for name in COMPARED} == plain[1]
    if driver == "sync":
        assert listener.started > 0


def _until(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    give_up = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < give_up, "condition not reached"
        time.sleep(0.002)


@pytest.mark.parametrize("guarded", [False, True], ids=["plain", "idempotent"])
def test_a_listener_installed_while_the_consumer_runs_sees_what_is_settled_after(
        guarded: bool) -> None:
    broker = InMemoryBroker()

    def handle(message: Message) -> None:
        pass

    handler = idempotent(MemoryChecker())(handle) if guarded else handle
    consumer = Consumer(broker, handler, topics=["t"], group="g", workers=2)
    consumer.start()
    try:
        for i in range(20):
            broker.publish("t", i, id=f"a{i}")
        _until(lambda: len(broker.acked) == 20)
        listener = Counting()
        with listening(listener):
            for i in range(30):
                broker.publish("t", i, id=f"b{i}")
            _until(lambda: len(broker.acked) == 50)
            _until(lambda: listener.counts["acked"] == 30)
        for i in range(10):  # uninstalled: the hot path again, nothing reported
            broker.publish("t", i, id=f"c{i}")
        _until(lambda: len(broker.acked) == 60)
    finally:
        consumer.stop(10)
    assert listener.counts["acked"] == 30
    assert listener.started == 30


def test_a_listener_installed_while_the_async_consumer_runs_sees_what_is_settled_after(
        ) -> None:
    broker = InMemoryBroker()
    listener = Counting()

    async def handle(message: Message) -> None:
        pass

    async def until(predicate: Callable[[], bool]) -> None:
        give_up = time.monotonic() + 30
        while not predicate():
            assert time.monotonic() < give_up, "condition not reached"
            await asyncio.sleep(0.002)

    async def main() -> None:
        consumer = AsyncConsumer(AsyncInMemoryBroker(broker), handle, topics=["t"],
                                 group="g")
        await consumer.start()
        try:
            for i in range(20):
                broker.publish("t", i, id=f"a{i}")
            await until(lambda: len(broker.acked) == 20)
            with listening(listener):
                for i in range(30):
                    broker.publish("t", i, id=f"b{i}")
                await until(lambda: listener.counts["acked"] == 30)
            for i in range(10):
                broker.publish("t", i, id=f"c{i}")
            await until(lambda: len(broker.acked) == 60)
        finally:
            await consumer.stop(10)

    asyncio.run(main())
    assert listener.counts["acked"] == 30
