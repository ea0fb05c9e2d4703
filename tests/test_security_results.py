"""Issue 25 item 7: stored results with an integrity check (``checker.result_key``).

Whoever can write to the dedup store chooses what a duplicate gets back. With a
``result_key`` every stored result is signed (HMAC-SHA256, bound to its store key) and a
duplicate gets a result back only if it passes the check: a result written without the
key (a forged ``{"refund_cents": 999999}``), altered, or moved from another key raises
:class:`ResultIntegrityError` and the handler is not run again. On every store (the
real Redis, PostgreSQL and MariaDB included) and the transactional checker, through
the decorator and through a Consumer.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from msgpatterns import Consumer, InMemoryBroker, Message, RetryPolicy
from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency import (
    Checker,
    MemoryChecker,
    ResultIntegrityError,
    ResultNotStored,
    idempotent,
)
from msgpatterns.idempotency.results import decode_result, encode_result
from msgpatterns.testing.checker_fixtures import SQL_STORES, STORES, checker_for

_MARKS = {"redis": pytest.mark.redis, "postgres": pytest.mark.postgres,
          "mysql": pytest.mark.mysql}
_KINDS = [pytest.param((store, False), marks=_MARKS.get(store, ()), id=store)
          for store in STORES]
_KINDS += [pytest.param((store, True), marks=_MARKS.get(store, ()), id=f"tx-{store}")
           for store in SQL_STORES]

KEY = secrets.token_bytes(32)


@pytest.fixture(params=_KINDS)
def checker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Checker]:
    store, transactional = request.param
    with checker_for(store, tmp_path, transactional=transactional) as built:
        yield built


def test_a_forged_stored_result_is_refused(checker: Any) -> None:
    """Issue 25 item 7: a result written by someone without the key is never returned
    to a duplicate (ResultIntegrityError); a signed one comes back; runs stay once."""
    runs: list[str] = []
    refund = {"o-1": 100, "o-2": 999_999}

    @idempotent(checker, store_result=True, group="refund")
    def handle(message: Message, tx: Any = None) -> dict[str, int]:
        runs.append(str(message.key))
        return {"refund_cents": refund[str(message.key)]}

    checker.result_key = KEY
    assert handle(Message({}, key="o-1")) == {"refund_cents": 100}
    assert handle(Message({}, key="o-1")) == {"refund_cents": 100}  # signed, checked

    checker.result_key = None  # the forger can write to the store, has no key
    assert handle(Message({}, key="o-2")) == {"refund_cents": 999_999}
    checker.result_key = KEY
    with pytest.raises(ResultIntegrityError, match="integrity"):
        handle(Message({}, key="o-2"))
    assert runs == ["o-1", "o-2"]  # the refused duplicate did not run the handler
    assert isinstance(ResultIntegrityError("x"), ResultNotStored)
    assert KEY.hex() not in repr(checker)


def test_a_consumer_dead_letters_a_duplicate_whose_result_is_forged() -> None:
    """Issue 25 item 7 (through the Consumer's batch claims): the duplicate of a key
    with a forged result is dead-lettered with the integrity reason."""
    checker = MemoryChecker()

    @idempotent(checker, store_result=True, group="refund")
    def refund(message: Message) -> dict[str, int]:
        return {"refund_cents": 999_999}

    refund(Message({}, key="o-9"))  # written without the key
    checker.result_key = KEY
    broker = InMemoryBroker()
    broker.publish("refunds", {}, key="o-9")
    Consumer(broker, refund, topics=["refunds"], group="g",
             retry=RetryPolicy(max_attempts=1)).run_until_idle(timeout=30)
    [dead] = broker.dead_letters
    assert "integrity" in dead.reason
    assert dead.error_type.endswith("ResultIntegrityError")


def test_signed_results_are_bound_to_their_key_and_text() -> None:
    """Issue 25 item 7: a signed text moved to another key, altered, or stripped of its
    signature fails the check; without a key, a signed text is read unchecked."""
    text = encode_result({"refund_cents": 100}, 1000, "ns:g:o-1", KEY)
    assert text.startswith("#")
    assert decode_result(text, "ns:g:o-1", KEY) == {"refund_cents": 100}
    assert decode_result(text, "ns:g:o-1") == {"refund_cents": 100}
    with pytest.raises(ResultIntegrityError):
        decode_result(text, "ns:g:o-2", KEY)  # moved
    with pytest.raises(ResultIntegrityError):
        decode_result(text.replace("100", "999"), "ns:g:o-1", KEY)  # altered
    with pytest.raises(ResultIntegrityError):
        decode_result(text[65:], "ns:g:o-1", KEY)  # unsigned
    with pytest.raises(ResultIntegrityError):
        decode_result(text, "ns:g:o-1", secrets.token_bytes(32))  # another key
    not_stored = encode_result(object(), 1000, "ns:g:o-1", KEY)
    with pytest.raises(ResultNotStored) as caught:
        decode_result(not_stored, "ns:g:o-1", KEY)
    assert not isinstance(caught.value, ResultIntegrityError)


@pytest.mark.parametrize("bad", [b"short", "a text key of enough length", 12345, b""])
def test_a_weak_result_key_is_a_configuration_error(bad: Any) -> None:
    """Issue 25 item 7: the key must be bytes of at least 16."""
    with pytest.raises(ConfigurationError, match="result_key"):
        MemoryChecker().result_key = bad
