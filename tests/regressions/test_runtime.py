"""The consumer runtime and the in-memory broker, regressions (first collected in issue
10) driven from the outside: the user's order of calls (stop() then close()), wrong
kinds of arguments, races against a fetch in progress, hostile handlers."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import partial
from typing import Any

import pytest

from msgpatterns import Consumer, InMemoryBroker, Message, NeedRetry, Reject, RetryPolicy
from msgpatterns.deadletter import DeadLetter
from msgpatterns.errors import BrokerClosed, ConfigurationError


def _until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait for ``predicate`` (a condition, not a duration); fail after ``timeout``."""
    give_up = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < give_up, "condition not reached"
        time.sleep(0.001)


def _stopping(consumer: Consumer) -> bool:
    return consumer._state.value != "running"


class _Wrapper:
    """A broker that delegates to an InMemoryBroker; subclasses override one verb."""

    def __init__(self, inner: InMemoryBroker) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _GatedFetch(_Wrapper):
    """The first fetch blocks until ``gate`` is set, then returns what is there."""

    def __init__(self, inner: InMemoryBroker) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.returned = threading.Event()
        self._first = True

    def fetch(self, topics: Sequence[str], group: str, max_messages: int = 1,
              timeout: float = 0.0) -> list[Message]:
        if not self._first:
            return self.inner.fetch(topics, group, max_messages, timeout)
        self._first = False
        self.entered.set()
        assert self.gate.wait(10)
        out = self.inner.fetch(topics, group, max_messages, 0.0)
        self.returned.set()
        return out


# -- hole 1: stop() and close() ------------------------------------------------------


def test_stop_hands_back_what_a_fetch_in_progress_returns() -> None:
    """Hole 1: stop() called while a fetch is in progress waits for that fetch and hands
    its messages back instead of handing them out; no handler runs."""
    inner = InMemoryBroker(seed=1)
    for i in range(3):
        inner.publish("t", i, key=str(i))
    broker = _GatedFetch(inner)
    calls: list[Any] = []
    consumer = Consumer(broker, lambda m: calls.append(m.body), topics=["t"], group="g",
                        poll_timeout=5.0)
    consumer.start()
    assert broker.entered.wait(5)
    seen: dict[str, Any] = {}

    def stopper() -> None:
        seen["result"] = consumer.stop(timeout=1.0)
        seen["fetch_came_back_first"] = broker.returned.is_set()
        seen["calls"] = list(calls)

    thread = threading.Thread(target=stopper)
    thread.start()
    _until(lambda: _stopping(consumer))
    broker.gate.set()
    thread.join(10)
    assert not thread.is_alive()
    assert seen["fetch_came_back_first"], "stop() returned while a fetch was in progress"
    assert seen["calls"] == [] and calls == []
    assert inner.in_flight("g") == 0
    assert inner.pending == 3
    assert consumer.stats.released == 3
    inner.close()


def test_stop_waits_for_a_running_handler_and_hands_its_message_back() -> None:
    """Hole 1: the workers are really joined: stop(0) does not return while a handler
    still runs; its message was handed back and its late outcome is ignored."""
    broker = InMemoryBroker(seed=1)
    broker.publish("t", "slow")
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def handler(message: Message) -> None:
        started.set()
        release.wait(10)
        finished.set()

    consumer = Consumer(broker, handler, topics=["t"], group="g", poll_timeout=0.05)
    consumer.start()
    assert started.wait(5)
    seen: dict[str, Any] = {}

    def stopper() -> None:
        seen["result"] = consumer.stop(0)
        seen["handler_finished"] = finished.is_set()

    thread = threading.Thread(target=stopper)
    thread.start()
    thread.join(0.5)  # gives a stop() that does not join the chance to return early
    release.set()
    thread.join(10)
    assert seen == {"result": False, "handler_finished": True}
    assert broker.in_flight("g") == 0 and broker.pending == 1 and broker.acked == []
    broker.close()


def test_stop_then_close_in_the_documented_order_loses_nothing() -> None:
    """Hole 1: stop() then broker.close(): no handler runs after stop() returned, and
    every message is acked or back in the broker (none stranded in flight)."""
    broker = InMemoryBroker(seed=2)
    for i in range(40):
        broker.publish("t", i, key=str(i % 5))
    stopped = threading.Event()
    late: list[int] = []
    handled = threading.Event()
    gate = threading.Event()

    def handler(message: Message) -> None:
        if stopped.is_set():
            late.append(message.body)
        handled.set()
        gate.wait(5)

    def stop(consumer: Consumer) -> None:
        consumer.stop(0)
        stopped.set()

    for ordered in (False, True):
        group = f"g{ordered}"
        stopped.clear()
        gate.clear()
        handled.clear()
        consumer = Consumer(broker, handler, topics=["t"], group=group, workers=3,
                            ordered=ordered, max_in_flight=8, poll_timeout=0.05)
        consumer.start()
        assert handled.wait(5)
        stopper = threading.Thread(target=stop, args=(consumer,))
        stopper.start()
        _until(partial(_stopping, consumer))
        gate.set()  # the handlers running at the stop finish
        stopper.join(10)
        assert stopped.is_set()
        assert broker.in_flight(group) == 0
        acked = sum(1 for m in broker.acked if m.receipt.group == group)
        assert acked + broker.pending_for(group) == 40
    broker.close()
    assert late == []
    with pytest.raises(BrokerClosed):
        broker.fetch(["t"], "g", timeout=0)


def test_closed_memory_broker_refuses_every_operation_at_once() -> None:
    """Hole 1: after InMemoryBroker.close() every operation raises BrokerClosed at once;
    a fetch waiting at the close returns at once."""
    broker = InMemoryBroker(seed=1)
    broker.publish("t", "a")
    (message,) = broker.fetch(["t"], "g", max_messages=1)
    waiting: list[Any] = []
    thread = threading.Thread(target=lambda: waiting.append(broker.fetch(["t"], "g", 1, 30.0)))
    thread.start()
    _until(lambda: thread.is_alive())
    broker.close()
    thread.join(5)
    assert not thread.is_alive() and waiting == [[]]
    record = DeadLetter.from_error(message, RuntimeError("x"), now=broker.now())
    for operation in (
        lambda: broker.publish("t", "b"),
        lambda: broker.subscribe("t", "g2"),
        lambda: broker.fetch(["t"], "g", 1, 30.0),
        lambda: broker.ack(message),
        lambda: broker.nack(message, 0.0),
        lambda: broker.dead_letter(message, record),
        lambda: broker.advance(1.0),
    ):
        with pytest.raises(BrokerClosed):
            operation()
    broker.close()  # idempotent
    assert broker.pending == 1  # the assertion views keep working


def test_close_racing_acks_each_ack_lands_or_raises() -> None:
    """Hole 1: close() racing acks from several threads: every ack either reached the
    broker or raised BrokerClosed; none is silently dropped."""
    broker = InMemoryBroker(seed=5)
    for i in range(400):
        broker.publish("t", i)
    messages = broker.fetch(["t"], "g", max_messages=400)
    refused: list[Message] = []
    lock = threading.Lock()
    barrier = threading.Barrier(5)

    def acker(part: list[Message]) -> None:
        barrier.wait()
        for m in part:
            try:
                broker.ack(m)
            except BrokerClosed:
                with lock:
                    refused.append(m)

    threads = [threading.Thread(target=acker, args=(messages[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    barrier.wait()
    broker.close()
    for t in threads:
        t.join(10)
    assert len(broker.acked) + len(refused) == 400
    assert {m.id for m in broker.acked}.isdisjoint(m.id for m in refused)
    with pytest.raises(BrokerClosed):  # and an ack after the close never lands
        broker.ack(messages[0])
    assert len(broker.acked) == 400 - len(refused)


# -- holes 3, 8, 10, 23: construction-time checks -------------------------------------


def test_async_handler_or_decoder_refused_at_construction() -> None:
    """Hole 3: an async def handler (or decoder) is refused with TypeError: it would be
    acked before its body ran."""
    broker = InMemoryBroker()

    async def handler(message: Message) -> None:
        raise RuntimeError("never awaited")

    class AsyncCallable:
        async def __call__(self, message: Message) -> None: ...

    async def decoder(raw: Any) -> Any:
        return raw

    for bad in (handler, AsyncCallable()):
        with pytest.raises(TypeError, match="async def") as refused:
            Consumer(broker, bad, topics=["t"], group="g")
        # it names the driver that runs async handlers, never "no async support"
        assert "msgpatterns.AsyncConsumer" in str(refused.value)
        assert "no async support" not in str(refused.value)
    with pytest.raises(TypeError, match=r"decoder.*AsyncConsumer"):
        Consumer(broker, lambda m: None, topics=["t"], group="g", decoder=decoder)


_BAD_ARGUMENTS: list[tuple[str, Any, str]] = [
    ("handler", "x", "handler"),
    ("handler", None, "handler"),
    ("retry", "x", "retry"),
    ("retry", RetryPolicy, "retry"),
    ("broker", object(), "broker"),
    ("topics", 5, "topics"),
    ("topics", None, "topics"),
    ("topics", [1], "topics"),
    ("topics", [""], "topics"),
    ("topics", [], "topic"),
    ("topics", b"t", "topics"),
    ("group", "", "group"),
    ("group", None, "group"),
    ("workers", 0, "workers"),
    ("workers", True, "workers"),
    ("workers", 1.5, "workers"),
    ("max_in_flight", 0, "max_in_flight"),
    ("fetch_batch", "64", "fetch_batch"),
    ("dead_letters", "x", "dead_letters"),
    ("decoder", "json", "decoder"),
    ("poll_timeout", 0, "poll_timeout"),
    ("poll_timeout", "1", "poll_timeout"),
]


@pytest.mark.parametrize(("option", "value", "named"), _BAD_ARGUMENTS,
                         ids=[f"{o}={v!r}" for o, v, _ in _BAD_ARGUMENTS])
def test_unusable_consumer_configuration_refused_at_construction(
        option: str, value: Any, named: str) -> None:
    """Holes 10 and 23: a wrong kind of argument is refused at construction with a
    ConfigurationError naming it (not a consumer that spins, dead-letters everything or
    fails every fetch)."""
    kwargs: dict[str, Any] = {
        "broker": InMemoryBroker(), "handler": lambda m: None, "topics": ["t"], "group": "g",
    }
    kwargs[option] = value
    broker, handler = kwargs.pop("broker"), kwargs.pop("handler")
    with pytest.raises(ConfigurationError, match=named):
        Consumer(broker, handler, **kwargs)


_BAD_DURATIONS = [-1, -0.5, math.nan, math.inf, 1e308, timedelta(seconds=-1),
                  timedelta(days=-3)]


@pytest.mark.parametrize("option", ["ack_timeout", "poll_timeout", "shutdown_timeout"])
@pytest.mark.parametrize("value", _BAD_DURATIONS, ids=repr)
def test_negative_durations_refused_in_every_form(option: str, value: Any) -> None:
    """Hole 8: every duration option of Consumer refuses negative (float or timedelta),
    NaN, infinite and huge values at construction."""
    with pytest.raises(ConfigurationError, match=option):
        Consumer(InMemoryBroker(), lambda m: None, topics=["t"], group="g",
                 **{option: value})


@pytest.mark.parametrize("value", _BAD_DURATIONS, ids=repr)
def test_stop_and_run_until_idle_refuse_negative_timeouts(value: Any) -> None:
    """Hole 8: stop(timeout) and run_until_idle(timeout) refuse bad durations at the
    call, before starting anything."""
    consumer = Consumer(InMemoryBroker(), lambda m: None, topics=["t"], group="g")
    with pytest.raises(ConfigurationError):
        consumer.run_until_idle(timeout=value)
    with pytest.raises(ConfigurationError):
        consumer.stop(timeout=value)
    assert consumer.in_flight == 0


@pytest.mark.parametrize("topic", ["", None, b"t"])
def test_memory_broker_publish_refuses_an_unusable_topic(topic: Any) -> None:
    """Hole 10: InMemoryBroker.publish("") (or a non-string topic) is refused."""
    broker = InMemoryBroker()
    with pytest.raises(ConfigurationError, match="topic"):
        broker.publish(topic, b"x")
    assert broker.stats.published == 0


# -- hole 17: virtual time jumps whenever nothing can run ------------------------------


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("ordered", [True, False])
def test_full_consumer_waiting_for_a_delayed_retry_jumps_virtual_time(
        ordered: bool, workers: int) -> None:
    """Hole 17: max_in_flight=1, key A asks for a retry in an hour while key B waits:
    run_until_idle jumps the virtual clock instead of spinning in real time."""
    broker = InMemoryBroker(seed=7)
    broker.publish("t", "a", key="A")
    broker.publish("t", "b", key="B")
    seen: list[tuple[str, int]] = []

    def handler(message: Message) -> None:
        seen.append((message.body, message.attempt))
        if message.body == "a" and message.attempt == 1:
            raise NeedRetry(delay=3600)

    start = broker.now()
    Consumer(broker, handler, topics=["t"], group="g", ordered=ordered, workers=workers,
             max_in_flight=1).run_until_idle(timeout=5)
    assert sorted(m.body for m in broker.acked) == ["a", "b"]
    assert ("a", 2) in seen and broker.pending == 0
    assert broker.now() - start >= 3600


# -- hole 18: BaseException from a handler --------------------------------------------


class _Custom(BaseException):
    pass


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("kind", [KeyboardInterrupt, SystemExit, GeneratorExit, _Custom])
def test_base_exception_fails_the_message_and_the_worker_survives(
        kind: type[BaseException], ordered: bool) -> None:
    """Hole 18: a handler raising a BaseException fails that message through the retry
    policy; with one worker the consumer keeps going and nothing is left pending."""
    broker = InMemoryBroker(seed=3)
    for i in range(5):
        broker.publish("t", i, key=str(i))
    broker.publish("t", "poison", key="p")

    def handler(message: Message) -> None:
        if message.body == "poison" or (message.body == 0 and message.attempt == 1):
            raise kind("from the handler")

    consumer = Consumer(broker, handler, topics=["t"], group="g", workers=1,
                        ordered=ordered, retry=RetryPolicy(max_attempts=3))
    consumer.run_until_idle(timeout=5)
    assert sorted(m.body for m in broker.acked) == [0, 1, 2, 3, 4]
    (dead,) = broker.dead_letters
    assert dead.message.body == "poison" and dead.attempts == 3
    assert broker.pending == 0


# -- hole 19: ack(error) types, unbuildable records, failing settlements ---------------


def test_ack_with_a_string_or_a_class_is_a_type_error_and_settles_nothing() -> None:
    """Hole 19: msg.ack("payment declined") and msg.ack(ValueError) raise TypeError at
    the call and do not settle; a proper ack afterwards still works."""
    broker = InMemoryBroker(seed=1)
    broker.publish("t", "order")
    errors: list[str] = []

    def handler(message: Message) -> None:
        message.disable_auto_ack()
        for wrong in ("payment declined", ValueError, 42):
            try:
                message.ack(wrong)  # type: ignore[arg-type]
            except TypeError as exc:
                errors.append(str(exc))
            assert not message.acked
        message.ack(Reject("payment declined"))

    Consumer(broker, handler, topics=["t"], group="g").run_until_idle(timeout=5)
    assert len(errors) == 3 and all("exception instance" in e for e in errors)
    (dead,) = broker.dead_letters
    assert "payment declined" in dead.reason


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ exploded")


def test_error_whose_str_raises_ends_in_exactly_one_dead_letter() -> None:
    """Hole 19: a handler raising an exception whose __str__ raises, max_attempts=3:
    three attempts, then exactly one dead letter; no loop."""
    broker = InMemoryBroker(seed=1)
    broker.publish("t", "x")
    calls: list[int] = []

    def handler(message: Message) -> None:
        calls.append(message.attempt)
        raise _Unprintable()

    Consumer(broker, handler, topics=["t"], group="g",
             retry=RetryPolicy(max_attempts=3)).run_until_idle(timeout=5)
    assert calls == [1, 2, 3]
    assert len(broker.dead_letters) == 1 and broker.pending == 0
    assert broker.stats.nacks == 2
    assert broker.stats.timeouts == 0, "a settlement hung until the visibility timeout"


class _FailsOnce(_Wrapper):
    """``verb`` raises once (a transient broker failure), then works."""

    def __init__(self, inner: InMemoryBroker, verb: str) -> None:
        super().__init__(inner)
        self.verb = verb
        self.failed = 0

    def _maybe_fail(self) -> None:
        if self.failed == 0:
            self.failed += 1
            raise ConnectionError(f"{self.verb} lost on the way")

    def ack(self, message: Message) -> None:
        if self.verb == "ack":
            self._maybe_fail()
        self.inner.ack(message)

    def nack(self, message: Message, delay: float = 0.0) -> None:
        if self.verb == "nack":
            self._maybe_fail()
        self.inner.nack(message, delay)

    def dead_letter(self, message: Message, record: DeadLetter) -> None:
        if self.verb == "dead_letter":
            self._maybe_fail()
        self.inner.dead_letter(message, record)


@pytest.mark.parametrize(("verb", "ordered"), [
    ("ack", False), ("ack", True), ("nack", False), ("dead_letter", False),
    ("dead_letter", True),
])
def test_a_failed_settlement_is_settled_another_way(verb: str, ordered: bool) -> None:
    """Hole 19 (and 14's rule): a broker call that fails while settling is settled
    another way at once (fallback dead letter, or nack for redelivery), never left in
    flight until the visibility timeout."""
    inner = InMemoryBroker(seed=4, visibility_timeout=600)
    inner.publish("t", verb)
    broker = _FailsOnce(inner, verb)

    def handler(message: Message) -> None:
        if verb == "nack" and message.attempt == 1:
            raise RuntimeError("transient")
        if verb == "dead_letter":
            raise Reject("never")

    Consumer(broker, handler, topics=["t"], group="g", ordered=ordered,
             retry=RetryPolicy(max_attempts=3)).run_until_idle(timeout=5)
    assert broker.failed == 1
    assert inner.stats.timeouts == 0, "the delivery hung until the visibility timeout"
    assert inner.pending == 0 and inner.in_flight() == 0
    assert len(inner.dead_letters) == (1 if verb == "dead_letter" else 0)


# -- hole 20: infinite delays never poison the fake's clock ----------------------------


def test_need_retry_with_infinite_delay_does_not_poison_the_clock() -> None:
    """Hole 20: a handler raising NeedRetry(delay=inf) fails like any error (retry
    policy); the fake broker's clock stays finite; a direct nack(inf) is refused."""
    broker = InMemoryBroker(seed=1)
    broker.publish("t", "x")

    def handler(message: Message) -> None:
        if message.attempt == 1:
            raise NeedRetry(delay=float("inf"))

    Consumer(broker, handler, topics=["t"], group="g").run_until_idle(timeout=5)
    assert [m.body for m in broker.acked] == ["x"]
    assert math.isfinite(broker.now())
    broker.publish("t", "y")
    assert math.isfinite(broker.published[-1].timestamp)
    (message,) = broker.fetch(["t"], "g")
    for delay in (math.inf, 1e308, math.nan, -1.0):
        with pytest.raises(ConfigurationError):
            broker.nack(message, delay)
    with pytest.raises(ConfigurationError):
        broker.advance(math.inf)
    for when in (math.inf, 1e308):
        with pytest.raises(ConfigurationError):
            broker.advance_to(when)
    assert math.isfinite(broker.now()) and broker.in_flight("g") == 1


# -- hole 21: stop() from a handler ----------------------------------------------------


@pytest.mark.parametrize("ordered", [False, True])
@pytest.mark.parametrize("how", ["run_until_idle", "run"])
def test_stop_from_a_handler_requests_the_stop_and_returns(how: str, ordered: bool) -> None:
    """Hole 21: consumer.stop() called from a handler returns False at once (no
    deadlock); run() / run_until_idle() return afterwards with nothing stranded."""
    broker = InMemoryBroker(seed=1)
    for i in range(10):
        broker.publish("t", i, key=str(i))
    results: list[bool] = []

    def handler(message: Message) -> None:
        if message.body == 3:
            results.append(consumer.stop())

    consumer = Consumer(broker, handler, topics=["t"], group="g", ordered=ordered,
                        poll_timeout=0.05)
    runner = threading.Thread(
        target=consumer.run if how == "run" else lambda: consumer.run_until_idle(timeout=30)
    )
    runner.start()
    runner.join(10)
    assert not runner.is_alive(), "stop() from a handler deadlocked"
    assert results == [False]
    assert broker.in_flight("g") == 0
    assert 3 in [m.body for m in broker.acked]


# -- hole 22: no thread left behind ----------------------------------------------------


def test_stopped_consumers_leave_no_threads_behind() -> None:
    """Hole 22: 30 consumers run to idle (default ack_timeout, so a deadline timer was
    armed) leave no thread alive: timer, workers, pump and lanes all end at stop."""
    before = {t.name for t in threading.enumerate()}
    broker = InMemoryBroker(seed=1)
    for i in range(30):
        broker.publish("t", i, key=str(i % 3))
    for n in range(30):
        consumer = Consumer(broker, lambda m: None, topics=["t"], group=f"g{n}",
                            workers=2, ordered=bool(n % 2), name=f"leak-{n}")
        consumer.run_until_idle(timeout=5)
        consumer.run_until_idle(timeout=5)  # a restart works and leaves nothing either
    after = {t.name for t in threading.enumerate()}
    assert after - before == set()
    assert broker.pending == 0


def test_two_stops_at_once_both_return_only_when_the_consumer_is_stopped() -> None:
    """Hole 1: stop() racing stop(): neither returns while a handler still runs."""
    broker = InMemoryBroker(seed=1)
    broker.publish("t", "slow")
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    def handler(message: Message) -> None:
        started.set()
        release.wait(10)
        finished.set()

    consumer = Consumer(broker, handler, topics=["t"], group="g", poll_timeout=0.05)
    consumer.start()
    assert started.wait(5)
    seen: list[bool] = []

    def stop() -> None:
        consumer.stop(0)
        seen.append(finished.is_set())

    stoppers = [threading.Thread(target=stop) for _ in range(2)]
    for thread in stoppers:
        thread.start()
    _until(partial(_stopping, consumer))
    stoppers[0].join(0.3)  # gives a stop() that does not wait the chance to return early
    release.set()
    for thread in stoppers:
        thread.join(10)
    assert seen == [True, True]
    broker.close()


class _BrokenPolicy(RetryPolicy):
    def decide(self, message: Message, error: BaseException | None) -> Any:
        raise RuntimeError("a bug in the retry policy")


def test_a_failing_retry_policy_still_ends_every_delivery() -> None:
    """Hole 19 (14's rule): when the retry policy itself raises, a success is acked and
    a failure is redelivered until max_attempts, then dead-lettered; nothing loops."""
    broker = InMemoryBroker(seed=1)
    broker.publish("t", "ok")
    broker.publish("t", "bad")
    calls: list[tuple[str, int]] = []

    def handler(message: Message) -> None:
        calls.append((message.body, message.attempt))
        if message.body == "bad":
            raise ValueError("no")

    Consumer(broker, handler, topics=["t"], group="g",
             retry=_BrokenPolicy(max_attempts=2)).run_until_idle(timeout=5)
    assert calls == [("ok", 1), ("bad", 1), ("bad", 2)]
    assert [m.body for m in broker.acked] == ["ok"]
    (dead,) = broker.dead_letters
    assert dead.message.body == "bad" and broker.pending == 0


@pytest.mark.parametrize("value", [math.inf, 1e308, -1.0, 0.0, math.nan], ids=repr)
def test_memory_broker_refuses_a_visibility_timeout_that_would_poison_its_clock(
        value: float) -> None:
    """Hole 20: a lease deadline at infinity would make run_until_idle jump the clock
    to inf: InMemoryBroker refuses such a visibility_timeout at construction."""
    with pytest.raises(ConfigurationError, match="visibility_timeout"):
        InMemoryBroker(visibility_timeout=value)



def test_closing_the_broker_under_a_running_consumer_stops_run() -> None:
    """Hole 1 (the other order): broker.close() while run() is consuming. Fetches
    then raise BrokerClosed; run() must return instead of retrying forever."""
    import threading

    broker = InMemoryBroker(seed=1)
    broker.publish("t", b"x")
    handled = threading.Event()

    def handler(message: Message) -> None:
        handled.set()

    consumer = Consumer(broker, handler, topics=["t"], group="g", poll_timeout=0.05)
    runner = threading.Thread(target=consumer.run)
    runner.start()
    assert handled.wait(10)
    broker.close()
    runner.join(10)
    assert not runner.is_alive()
