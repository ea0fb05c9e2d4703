"""The settlement rule for code that owns its loop: a handler's outcome becomes a typed
decision from the same RetryPolicy the Consumer uses (issue 13, item 1)."""

from __future__ import annotations

import pytest

from msgpatterns import Backoff, Message, NeedRetry, Reject, RetryPolicy
from msgpatterns import headers as h
from msgpatterns.settlement import (
    Ack,
    DeadLetterIt,
    RetryLater,
    RetryNow,
    run_handler,
    settle,
)

POLICY = RetryPolicy(max_attempts=3, backoff=Backoff.levels([10, 30]), local_retries=2,
                     local_backoff=Backoff.fixed(0.5))


def delivery(attempt: int = 1, **headers: str) -> Message:
    return Message(b"body", id="m1", key="k1", topic="orders", attempt=attempt,
                   headers=headers)


def test_success_is_an_ack_with_the_result() -> None:
    assert settle(delivery(), None, policy=POLICY, result=42) == Ack(42)


def test_a_failure_is_redelivered_later_with_attempt_and_history() -> None:
    error = ValueError("downstream down")
    decision = settle(delivery(attempt=2, trace="t1"), error, policy=POLICY, now=1000.0)
    assert isinstance(decision, RetryLater)
    assert decision.delay == 30 and decision.attempt == 3
    assert decision.headers["trace"] == "t1"
    assert decision.headers[h.FIRST_FAILED_AT] == "1000.0"
    assert decision.headers[h.ERROR_TYPE] == "ValueError"
    assert decision.headers[h.ERROR_MESSAGE] == "downstream down"


def test_the_first_failure_time_survives_later_failures() -> None:
    message = delivery(attempt=2, **{h.FIRST_FAILED_AT: "900.0"})
    decision = settle(message, ValueError("again"), policy=POLICY, now=1000.0)
    assert isinstance(decision, RetryLater)
    assert decision.headers[h.FIRST_FAILED_AT] == "900.0"
    assert decision.headers[h.LAST_FAILED_AT] == "1000.0"


def test_need_retry_without_delay_is_retried_now_then_later() -> None:
    error = NeedRetry()
    assert settle(delivery(), error, policy=POLICY) == RetryNow(0.5, error)
    tired = delivery()
    tired.local_retries = 2
    assert isinstance(settle(tired, NeedRetry(), policy=POLICY), RetryLater)


def test_need_retry_with_delay_and_reject_and_last_attempt() -> None:
    later = settle(delivery(), NeedRetry(delay=120), policy=POLICY)
    assert isinstance(later, RetryLater) and later.delay == 120
    dead = settle(delivery(), Reject("bad payload"), policy=POLICY, group="billing")
    assert isinstance(dead, DeadLetterIt)
    assert dead.reason == "rejected: bad payload" and dead.record.group == "billing"
    last = settle(delivery(attempt=3), RuntimeError("boom"), policy=POLICY, now=5.0)
    assert isinstance(last, DeadLetterIt)
    assert last.record.attempts == 3 and last.record.error_message == "boom"
    assert "RuntimeError: boom" in last.record.traceback


def test_run_handler_retries_in_process_then_decides() -> None:
    calls: list[int] = []
    slept: list[float] = []

    def handler(message: Message) -> str:
        calls.append(message.local_retries)
        if len(calls) < 3:
            raise NeedRetry()
        return "ok"

    decision = run_handler(handler, delivery(), policy=POLICY, sleep=slept.append)
    assert decision == Ack("ok")
    assert calls == [0, 1, 2] and slept == [0.5, 0.5]


def test_run_handler_turns_every_exception_into_a_decision() -> None:
    class Odd(BaseException):
        pass

    def handler(message: Message) -> None:
        raise Odd()

    assert isinstance(run_handler(handler, delivery(), policy=POLICY), RetryLater)


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_run_handler_lets_the_process_stop(stop: type[BaseException]) -> None:
    def handler(message: Message) -> None:
        raise stop()

    with pytest.raises(stop):
        run_handler(handler, delivery(), policy=POLICY)
