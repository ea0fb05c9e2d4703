"""DESIGN 3: NeedRetry local then delayed, Reject and fatal, Backoff schedules, max
attempts then a full dead letter, and a durable attempt count."""

from __future__ import annotations

import itertools
import threading

import pytest
import tenacity

from msgpatterns import (
    Backoff,
    Consumer,
    InMemoryBroker,
    InProgress,
    Message,
    NeedRetry,
    Reject,
    RetryPolicy,
)
from msgpatterns import headers as h
from msgpatterns.retry import ROCKETMQ_LEVELS, Action
from msgpatterns.testing import assert_all_acked

ROCKETMQ = [10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800, 3600, 7200]


# -- Backoff ------------------------------------------------------------------------


def test_rocketmq_schedule_is_the_sixteen_levels() -> None:
    backoff = Backoff.rocketmq()
    assert [backoff.delay(n) for n in range(1, 17)] == ROCKETMQ
    assert backoff.delay(40) == 7200  # past the end: the last level


def test_levels_schedule_and_timedelta() -> None:
    from datetime import timedelta

    backoff = Backoff.levels([1, timedelta(minutes=1), 5.5])
    assert [backoff.delay(n) for n in (1, 2, 3, 4)] == [1, 60, 5.5, 5.5]
    with pytest.raises(ValueError, match="at least one"):
        Backoff.levels([])


def test_exponential_without_jitter_doubles_up_to_max() -> None:
    backoff = Backoff.exponential(initial=1, factor=2, max=10, jitter=False)
    assert [backoff.delay(n) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]


def test_exponential_jitter_is_on_by_default_and_bounded() -> None:
    backoff = Backoff.exponential(initial=1, factor=2, max=100)
    samples = [backoff.delay(4) for _ in range(300)]
    assert all(0 <= s <= 8 for s in samples)
    assert len({round(s, 6) for s in samples}) > 100  # really random


def test_backoff_is_a_tenacity_wait_strategy() -> None:
    calls: list[float] = []
    retrying = tenacity.Retrying(
        wait=Backoff.levels([0.5, 1.5]),
        stop=tenacity.stop_after_attempt(3),
        sleep=calls.append,
        reraise=True,
    )
    with pytest.raises(ZeroDivisionError):
        retrying(lambda: 1 / 0)
    assert calls == [0.5, 1.5]


# -- RetryPolicy.decide ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "attempt", "local", "action", "delay"),
    [
        (None, 1, 0, Action.ACK, 0.0),
        (NeedRetry(), 1, 0, Action.RETRY_LOCALLY, None),
        (NeedRetry(), 1, 3, Action.REDELIVER, 10.0),
        (NeedRetry(delay=42), 1, 0, Action.REDELIVER, 42.0),
        (InProgress(delay=7), 2, 0, Action.REDELIVER, 7.0),
        (ValueError("boom"), 2, 0, Action.REDELIVER, 30.0),
        (ValueError("boom"), 5, 0, Action.DEAD_LETTER, 0.0),
        (Reject("never"), 1, 0, Action.DEAD_LETTER, 0.0),
        (KeyError("fatal"), 1, 0, Action.DEAD_LETTER, 0.0),
    ],
)
def test_decide(
    error: BaseException | None, attempt: int, local: int, action: Action, delay: float | None
) -> None:
    policy = RetryPolicy(max_attempts=5, backoff=Backoff.rocketmq(), fatal=(KeyError,))
    message = Message(b"", attempt=attempt)
    message.local_retries = local
    verdict = policy.decide(message, error)
    assert verdict.action is action
    if delay is not None:
        assert verdict.delay == delay


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError, match="cannot be negative"):
        NeedRetry(delay=-1)


# -- through the consumer ---------------------------------------------------------------


def test_rocketmq_schedule_to_dead_letter_on_virtual_time() -> None:
    broker = InMemoryBroker(seed=1)
    broker.publish("orders", b'{"id": 1}', key="order-1", headers={"trace": "abc"})
    start = broker.now()
    calls: list[int] = []

    def always_fails(message: Message) -> None:
        calls.append(message.attempt)
        raise RuntimeError(f"downstream down (attempt {message.attempt})")

    policy = RetryPolicy(max_attempts=17, backoff=Backoff.rocketmq())
    Consumer(broker, always_fails, topics=["orders"], group="g", retry=policy).run_until_idle(
        timeout=10
    )

    assert calls == list(range(1, 18))
    nacks = [e for e in broker.history if e.kind == "nack"]
    assert [e.delay for e in nacks] == ROCKETMQ == list(ROCKETMQ_LEVELS)
    deliveries = [e.at for e in broker.history if e.kind == "deliver"]
    gaps = [b - a for a, b in itertools.pairwise(deliveries)]
    for gap, delay in zip(gaps, ROCKETMQ, strict=True):
        assert delay <= gap < delay + 1.0  # never early; late only by processing time
    assert broker.now() - start >= sum(ROCKETMQ)  # the clock really jumped over 2h+

    (dead,) = broker.dead_letters
    assert dead.attempts == 17
    assert dead.message.body == b'{"id": 1}'
    assert dead.message.key == "order-1"
    assert dead.message.topic == "orders"
    assert dead.message.headers["trace"] == "abc"
    assert dead.error_type.endswith("RuntimeError")
    assert dead.error_message == "downstream down (attempt 17)"
    assert "RuntimeError: downstream down" in dead.traceback
    assert dead.first_failed_at < dead.last_failed_at
    assert dead.last_failed_at - dead.first_failed_at >= sum(ROCKETMQ)
    assert dead.group == "g"
    assert broker.pending == 0


def test_need_retry_is_retried_locally_then_delayed(fake_broker: InMemoryBroker) -> None:
    fake_broker.publish("t", b"x")
    seen: list[tuple[int, int]] = []

    def handler(message: Message) -> None:
        seen.append((message.attempt, message.local_retries))
        if message.attempt < 2:
            raise NeedRetry()

    policy = RetryPolicy(local_retries=3, local_backoff=Backoff.fixed(0.001))
    Consumer(fake_broker, handler, topics=["t"], group="g", retry=policy).run_until_idle(
        timeout=10
    )
    assert seen == [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0)]
    delivers = [e for e in fake_broker.history if e.kind == "deliver"]
    assert len(delivers) == 2  # local retries never went back to the broker
    assert_all_acked(fake_broker)


def test_need_retry_with_delay_skips_local_retries(fake_broker: InMemoryBroker) -> None:
    fake_broker.publish("t", b"x")
    seen: list[tuple[int, int]] = []

    def handler(message: Message) -> None:
        seen.append((message.attempt, message.local_retries))
        if message.attempt == 1:
            raise NeedRetry(delay=120, reason="not yet")

    Consumer(fake_broker, handler, topics=["t"], group="g").run_until_idle(timeout=10)
    assert seen == [(1, 0), (2, 0)]
    (nack,) = [e for e in fake_broker.history if e.kind == "nack"]
    assert nack.delay == 120


@pytest.mark.parametrize("error", [Reject("bad order"), KeyError("missing field")])
def test_reject_and_fatal_go_straight_to_dead_letter(
    fake_broker: InMemoryBroker, error: Exception
) -> None:
    fake_broker.publish("t", b"x")
    calls = []

    def handler(message: Message) -> None:
        calls.append(message)
        raise error

    policy = RetryPolicy(fatal=(KeyError,))
    Consumer(fake_broker, handler, topics=["t"], group="g", retry=policy).run_until_idle(
        timeout=10
    )
    assert len(calls) == 1
    (dead,) = fake_broker.dead_letters
    assert dead.attempts == 1
    assert str(error) in dead.reason


def test_attempt_count_survives_a_consumer_restart(fake_broker: InMemoryBroker) -> None:
    fake_broker.publish("t", b"x")
    failed = threading.Event()

    def failing(message: Message) -> None:
        failed.set()
        raise NeedRetry(delay=60, reason="try later")

    first = Consumer(fake_broker, failing, topics=["t"], group="g")
    first.start()
    assert failed.wait(10)
    first.stop(5)

    seen: list[Message] = []
    second = Consumer(fake_broker, seen.append, topics=["t"], group="g")  # a new process
    second.run_until_idle(timeout=10)
    (message,) = seen
    assert message.attempt == 2
    assert h.FIRST_FAILED_AT in message.headers  # the failure history travelled along
    assert message.headers[h.ERROR_TYPE] == "NeedRetry"
    assert_all_acked(fake_broker)


def test_malformed_body_is_dead_lettered_and_the_consumer_keeps_going(
    fake_broker: InMemoryBroker,
) -> None:
    import json

    bodies = [b'{"n": 1}', b"{not json", b'{"n": 3}', b'{"n": 4}']
    for body in bodies:
        fake_broker.publish("t", body)
    handled: list[int] = []

    consumer = Consumer(
        fake_broker, lambda m: handled.append(m.body["n"]), topics=["t"], group="g",
        decoder=json.loads,
    )
    consumer.run_until_idle(timeout=10)
    assert handled == [1, 3, 4]
    (dead,) = fake_broker.dead_letters
    assert dead.message.body == b"{not json"
    assert "cannot decode body" in dead.reason
    assert dead.error_type.endswith("MalformedMessage")


def test_handler_that_raises_on_bad_input_dead_letters_it(fake_broker: InMemoryBroker) -> None:
    for body in (b"1", b"oops", b"3"):
        fake_broker.publish("t", body)
    total: list[int] = []

    def handler(message: Message) -> None:
        total.append(int(message.body))  # ValueError on b"oops"

    policy = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(5))
    Consumer(fake_broker, handler, topics=["t"], group="g", retry=policy).run_until_idle(
        timeout=10
    )
    assert sorted(total) == [1, 3]
    (dead,) = fake_broker.dead_letters
    assert dead.attempts == 3
    assert "invalid literal for int()" in dead.error_message
