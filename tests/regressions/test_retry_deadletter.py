"""Retry schedules, durations and dead-letter records, regressions (first collected in
issue 10) driven from the outside: the user's RetryPolicy and handler through Consumer
and the in-memory broker."""

from __future__ import annotations

import math
from datetime import timedelta

import pytest
import tenacity

from msgpatterns import Backoff, Consumer, InMemoryBroker, Message, NeedRetry, RetryPolicy
from msgpatterns.errors import ConfigurationError, seconds


def _redelivery_delays(policy: RetryPolicy, attempts: int) -> list[float]:
    broker = InMemoryBroker(seed=3)
    broker.publish("jobs", b"x", key="k")

    def always_fails(message: Message) -> None:
        raise RuntimeError(f"down (attempt {message.attempt})")

    Consumer(broker, always_fails, topics=["jobs"], group="g", retry=policy).run_until_idle(
        timeout=10
    )
    assert len(broker.dead_letters) == 1
    return [e.delay for e in broker.history if e.kind == "nack"][: attempts - 1]


def test_backoff_plus_tenacity_wait_is_still_the_schedule() -> None:
    """Hole 7: Backoff + tenacity.wait_fixed used to become a wait_combine without
    .delay: decide crashed and the message came back 900 s later. Now the composed
    schedule is honoured: 10+5, 20+5, 40+5."""
    backoff = Backoff.exponential(initial=10, jitter=False) + tenacity.wait_fixed(5)
    assert isinstance(backoff, Backoff)
    policy = RetryPolicy(max_attempts=4, backoff=backoff)
    assert _redelivery_delays(policy, 4) == [15.0, 25.0, 45.0]


@pytest.mark.parametrize(
    ("backoff", "expected"),
    [
        (tenacity.wait_fixed(3) + Backoff.fixed(1), [4.0, 4.0]),  # tenacity on the left
        (tenacity.wait_incrementing(start=2, increment=3), [2.0, 5.0]),  # plain tenacity
        (sum([Backoff.fixed(1), Backoff.levels([2, 4])]), [3.0, 5.0]),
        (Backoff.exponential(initial=100, jitter=False).cap(150), [100.0, 150.0]),
        (Backoff.fixed(0).floor(7), [7.0, 7.0]),
    ],
)
def test_every_composition_is_a_valid_schedule(
    backoff: object, expected: list[float]
) -> None:
    """Hole 7: any composition a tenacity user would write stays a schedule."""
    assert _redelivery_delays(RetryPolicy(max_attempts=3, backoff=backoff), 3) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["x", object(), None])
def test_retry_policy_refuses_what_is_not_a_schedule(bad: object) -> None:
    """Hole 7: a RetryPolicy whose backoff cannot give delays is refused at construction."""
    with pytest.raises(ConfigurationError):
        RetryPolicy(backoff=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{"max_attempts": "3"}, {"max_attempts": 0}, {"local_retries": -1}, {"fatal": ["x"]},
     {"fatal": (ValueError, 3)}],
)
def test_retry_policy_refuses_bad_options(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value",
    [-1, -0.001, timedelta(seconds=-1), timedelta(microseconds=-1), math.nan, math.inf,
     -math.inf, 1e308, "5", True],
)
def test_durations_refuse_negative_and_non_finite_in_every_form(value: object) -> None:
    """Hole 8: a negative timedelta was accepted; NaN and inf too."""
    with pytest.raises(ConfigurationError):
        seconds(value)  # type: ignore[arg-type]


def test_durations_accept_the_ordinary_forms() -> None:
    assert seconds(timedelta(minutes=2)) == 120.0
    assert seconds(0) == 0.0
    assert seconds(1.5) == 1.5
    assert seconds(None) is None


@pytest.mark.parametrize("delay", [math.inf, 1e308, -5, timedelta(days=-1), math.nan])
def test_need_retry_refuses_unusable_delays_when_raised(delay: object) -> None:
    """Holes 14 and 20: NeedRetry(delay=inf) overflowed RabbitMQ's delay bucket and
    poisoned the fake broker's clock. It is refused where it is raised."""
    with pytest.raises(ConfigurationError):
        NeedRetry(delay=delay)  # type: ignore[arg-type]


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


@pytest.mark.parametrize(
    "error",
    [_Unprintable(), ValueError("card \udcff declined"), RuntimeError("\x00" * 3)],
    ids=["str-raises", "lone-surrogate", "nul"],
)
def test_unprintable_failures_end_in_exactly_one_dead_letter(error: Exception) -> None:
    """Hole 19: an exception whose str() raises made DeadLetter.from_error fail, so the
    handler ran thousands of times and nothing was dead-lettered. Now max_attempts
    always ends in one dead letter with a readable record."""
    broker = InMemoryBroker(seed=5)
    broker.publish("payments", b"p", key="order-1")
    calls: list[int] = []

    def handler(message: Message) -> None:
        calls.append(message.attempt)
        raise error

    policy = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(1))
    Consumer(broker, handler, topics=["payments"], group="g", retry=policy).run_until_idle(
        timeout=10
    )

    assert calls == [1, 2, 3]
    (dead,) = broker.dead_letters
    assert dead.attempts == 3
    assert dead.error_type.endswith(type(error).__qualname__)
    dead.error_message.encode("utf-8")  # always encodable
    dead.reason.encode("utf-8")
    dead.to_json()
    assert broker.pending == 0
