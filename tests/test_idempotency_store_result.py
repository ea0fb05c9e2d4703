"""store_result: a duplicate gets the handler's stored result, on every store."""

from __future__ import annotations

import itertools
import logging
import threading
from collections import defaultdict
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from msgpatterns import Consumer, InMemoryBroker, Message, RetryPolicy
from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency import (
    Checker,
    RedisChecker,
    ResultNotStored,
    SqlChecker,
    Status,
    TransactionalSqlChecker,
    idempotent,
)
from msgpatterns.retry import Backoff
from msgpatterns.testing import assert_all_acked
from msgpatterns.testing.checker_fixtures import SQL_STORES, STORES, checker_for, store_params

_MARKS = {"redis": pytest.mark.redis, "postgres": pytest.mark.postgres,
          "mysql": pytest.mark.mysql}
_KINDS = [pytest.param((store, False), marks=_MARKS.get(store, ()), id=store)
          for store in STORES]
_KINDS += [pytest.param((store, True), marks=_MARKS.get(store, ()), id=f"tx-{store}")
           for store in SQL_STORES]


@pytest.fixture(params=_KINDS)
def checker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Checker]:
    store, transactional = request.param
    with checker_for(store, tmp_path, transactional=transactional) as built:
        yield built


class Charges:
    """A payment provider's side: each call charges once and returns a new charge id."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.lock = threading.Lock()
        self.charged: dict[str, int] = defaultdict(int)

    def charge(self, key: str) -> dict[str, Any]:
        with self.lock:
            self.charged[key] += 1
            return {"charge_id": f"ch-{next(self.ids)}", "order": key}


def test_a_duplicate_call_returns_the_stored_result_without_running_the_body(
    checker: Checker,
) -> None:
    charges = Charges()

    @idempotent(checker, store_result=True, group="charge")
    def charge(message: Message, tx: Any = None) -> dict[str, Any]:
        return charges.charge(str(message.key))

    first = charge(Message({}, key="o-1", id="m-1"))
    again = charge(Message({}, key="o-1", id="m-2"))
    assert first == again == {"charge_id": "ch-1", "order": "o-1"}
    assert charges.charged == {"o-1": 1}
    # the batch claim carries the stored result too
    if not checker.passes_tx:
        (claim,) = checker.claim_many(["o-1"], group="charge")
        assert claim.status is Status.DONE
        assert claim.stored_result() == first


def test_duplicate_deliveries_through_the_consumer_all_see_the_same_result(
    checker: Checker,
) -> None:
    broker = InMemoryBroker(seed=3, duplicate_rate=0.5)
    keys = [f"order-{n}" for n in range(30)]
    for key in keys:
        broker.publish("orders", {}, key=key)
    charges = Charges()
    returned: dict[str, list[Any]] = defaultdict(list)

    @idempotent(checker, store_result=True, group="charge")
    def charge(message: Message, tx: Any = None) -> dict[str, Any]:
        return charges.charge(str(message.key))

    def handle(message: Message) -> None:
        returned[str(message.key)].append(charge(message))

    Consumer(broker, handle, topics=["orders"], group="billing",
             retry=RetryPolicy(max_attempts=5, backoff=Backoff.fixed(1.0))
             ).run_until_idle(timeout=60)
    assert_all_acked(broker)
    assert broker.stats.duplicates > 0
    assert dict(charges.charged) == dict.fromkeys(keys, 1)
    assert sum(len(values) for values in returned.values()) > len(keys)
    for key, values in returned.items():
        assert values == [values[0]] * len(values), key
        assert values[0]["order"] == key


@pytest.mark.parametrize("result", [
    None, 0, -1.5, "", "x" * 1000, [], {}, [1, [2, [3]]], {"a": {"b": None}},
    "nul\x00inside", "lone \udcff surrogate", "\U0001f600 émoji", {"k\x00": "\ud800"},
    [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]],
], ids=lambda value: repr(value)[:20])
def test_hostile_json_results_come_back_exactly(checker: Checker, result: Any) -> None:
    runs = []

    @idempotent(checker, key=lambda n: n, store_result=True)
    def handle(n: int, tx: Any = None) -> Any:
        runs.append(n)
        return result

    assert handle(1) == result
    assert handle(1) == result
    assert runs == [1]


def test_a_result_over_the_limit_completes_the_key_and_the_duplicate_says_why(
    checker: Checker, caplog: pytest.LogCaptureFixture,
) -> None:
    runs = []

    @idempotent(checker, key=lambda n: n, store_result=True, max_result_bytes=100)
    def handle(n: int, tx: Any = None) -> str:
        runs.append(n)
        return "y" * 200

    with caplog.at_level(logging.ERROR, "msgpatterns.idempotency"):
        assert handle(1) == "y" * 200  # the first caller gets its result
    assert "max_result_bytes=100" in caplog.text
    with pytest.raises(ResultNotStored, match="202 bytes of JSON, over max_result_bytes=100"):
        handle(1)
    assert runs == [1]  # never applied twice
    assert checker.stats.results_not_stored == 1


class Money:
    def __init__(self, cents: int) -> None:
        self.cents = cents


@pytest.mark.parametrize(("result", "named"), [
    (Money(5), "test_idempotency_store_result.Money"), (Decimal("1.5"), "decimal.Decimal"),
    ({1, 2}, "set"),
    (float("nan"), "float"), ({"when": b"bytes"}, "dict"),
], ids=["object", "decimal", "set", "nan", "bytes-inside"])
def test_a_result_that_is_not_json_completes_the_key_and_names_its_type(
    checker: Checker, caplog: pytest.LogCaptureFixture, result: Any, named: str,
) -> None:
    runs = []

    @idempotent(checker, key=lambda n: n, store_result=True)
    def handle(n: int, tx: Any = None) -> Any:
        runs.append(n)
        return result

    with caplog.at_level(logging.ERROR, "msgpatterns.idempotency"):
        assert handle(1) is result
    assert f"not JSON-serialisable ({named}" in caplog.text
    record = next(r for r in caplog.records if "not JSON-serialisable" in r.getMessage())
    assert record.exc_info is not None and issubclass(record.exc_info[0], TypeError)
    with pytest.raises(ResultNotStored, match=f"not JSON-serialisable \\({named}"):
        handle(1)
    assert runs == [1]


def test_a_cyclic_or_too_deep_result_is_not_stored_but_the_key_is_done(
    checker: Checker,
) -> None:
    cyclic: list[Any] = []
    cyclic.append(cyclic)
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    values = {1: cyclic, 2: deep}
    runs = []

    @idempotent(checker, key=lambda n: n, store_result=True)
    def handle(n: int, tx: Any = None) -> Any:
        runs.append(n)
        return values[n]

    for n in (1, 2):
        assert handle(n) is values[n]
        with pytest.raises(ResultNotStored, match="not JSON-serialisable"):
            handle(n)
    assert runs == [1, 2]


def test_a_key_done_without_store_result_raises_result_not_stored(checker: Checker) -> None:
    runs = []

    def body(n: int, tx: Any = None) -> str:
        runs.append(n)
        return "r"

    plain = idempotent(checker, key=lambda n: n, group="g")(body)
    storing = idempotent(checker, key=lambda n: n, group="g", store_result=True)(body)
    assert plain(1) == "r"
    with pytest.raises(ResultNotStored, match="no result was stored"):
        storing(1)
    assert runs == [1]


def test_batch_completion_stores_one_result_per_claim(checker: Checker) -> None:
    if checker.passes_tx:
        assert isinstance(checker, TransactionalSqlChecker)
        with checker.engine.begin() as tx:
            claims = checker.claim_many(["a", "b", "c"], group="batch", tx=tx)
            checker.complete_many(claims, [{"n": 1}, None, Money(1)], tx=tx)
        with checker.engine.begin() as tx:
            again = checker.claim_many(["a", "b", "c", "d"], group="batch", tx=tx)
    else:
        claims = checker.claim_many(["a", "b", "c"], group="batch")
        assert checker.complete_many(claims, [{"n": 1}, None, Money(1)]) == [True] * 3
        again = checker.claim_many(["a", "b", "c", "d"], group="batch")
    assert [c.status for c in again] == [Status.DONE] * 3 + [Status.CLAIMED]
    assert again[0].stored_result() == {"n": 1}
    assert again[1].stored_result() is None
    with pytest.raises(ResultNotStored, match="Money"):
        again[2].stored_result()
    if not checker.passes_tx:
        with pytest.raises(ValueError, match="one result per claim"):
            checker.complete_many(again[3:], [1, 2])


def test_misuse_is_refused_at_decoration(checker: Checker) -> None:
    with pytest.raises(ConfigurationError, match="max_result_bytes"):
        idempotent(checker, store_result=True, max_result_bytes=0)
    with pytest.raises(ConfigurationError, match="max_result_bytes"):
        idempotent(checker, store_result=True, max_result_bytes=10**9)
    with pytest.raises(ConfigurationError, match="on_duplicate"):
        idempotent(checker, store_result=True, on_duplicate=lambda m: None)


@pytest.mark.parametrize("store", store_params(*SQL_STORES))
def test_a_table_created_without_the_result_column_gets_it(
    store: str, tmp_path: Path,
) -> None:
    """Tables of older versions keep working: the nullable column is added once, and a
    second checker (another process) finds it there."""
    with checker_for(store, tmp_path) as built:
        assert isinstance(built, SqlChecker)
        table = built.store.table
        from msgpatterns.idempotency.sql_table import dedup_table

        old = dedup_table(table.name, sa.MetaData(), with_result=False)
        old.create(built.engine)
        with built.engine.begin() as conn:
            conn.execute(old.insert().values(
                dedup_key="msgpatterns:g:old", state="D", owner_token="t" * 32,
                fingerprint=None, expires_at=2**53, updated_at=0))
        runs = []

        @idempotent(built, key=lambda n: n, group="g", store_result=True)
        def handle(n: str) -> dict[str, str]:
            runs.append(n)
            return {"n": n}

        assert handle("new") == {"n": "new"}
        assert handle("new") == {"n": "new"}
        with pytest.raises(ResultNotStored):
            handle("old")
        assert runs == ["new"]
        columns = {c["name"] for c in sa.inspect(built.engine).get_columns(table.name)}
        assert "result" in columns
        other = SqlChecker(built.engine, table.name, namespace=built.namespace)
        assert other.claim("new", group="g").stored_result() == {"n": "new"}


@pytest.mark.parametrize("store", store_params("fakeredis", "sqlite", "redis", "postgres"))
def test_write_behind_completions_carry_the_result(store: str, tmp_path: Path) -> None:
    """A duplicate seen before the queued completion is written gets the result from the
    queue; after the flush, any process gets it from the store."""
    runs = []
    with checker_for(store, tmp_path, write_behind=0.5) as built:
        @idempotent(built, key=lambda n: n, group="wb", store_result=True)
        def handle(n: int) -> dict[str, int]:
            runs.append(n)
            return {"n": n, "run": len(runs)}

        assert handle(1) == {"n": 1, "run": 1}
        assert handle(1) == {"n": 1, "run": 1}  # still queued: answered in process
        assert built.flush(timeout=10)
        assert isinstance(built, SqlChecker | RedisChecker)
        (claim,) = built.claim_many([1], group="wb")
        assert claim.stored_result() == {"n": 1, "run": 1}
    assert runs == [1]


def test_under_a_consumer_a_duplicate_without_a_stored_result_is_dead_lettered_once(
    tmp_path: Path,
) -> None:
    """ResultNotStored is a Reject: the duplicate goes to the dead letters with the
    reason; the effect was applied once and the first delivery was acked."""
    broker = InMemoryBroker(seed=1)
    broker.publish("orders", {}, key="o-1", id="m-1")
    broker.publish("orders", {}, key="o-1", id="m-2")  # a resend by the producer
    runs = []
    with checker_for("memory", tmp_path) as built:
        @idempotent(built, store_result=True, max_result_bytes=10)
        def handle(message: Message) -> str:
            runs.append(message.id)
            return "far too long for ten bytes"

        Consumer(broker, handle, topics=["orders"], group="billing").run_until_idle(timeout=30)
    assert runs == ["m-1"]
    (dead,) = broker.dead_letters
    assert "over max_result_bytes=10" in dead.reason
    assert "not repeated" in dead.reason


def test_an_old_table_that_cannot_be_altered_keeps_working_without_results(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """Without the privilege to add the column (here: an SQLite authorizer refusing
    ALTER TABLE), the checker logs the statement to run and keeps deduplicating; a
    stored result is simply not there."""
    import sqlite3

    from msgpatterns.idempotency.sql_table import dedup_table

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'old.db'}")
    dedup_table("dedup_old", sa.MetaData(), with_result=False).create(engine)
    engine.dispose()  # every connection from now on has the authorizer

    @sa.event.listens_for(engine, "connect")
    def no_alter(dbapi_connection: Any, _: Any) -> None:
        def authorise(action: int, *_: Any) -> int:
            return sqlite3.SQLITE_DENY if action == sqlite3.SQLITE_ALTER_TABLE \
                else sqlite3.SQLITE_OK
        dbapi_connection.set_authorizer(authorise)

    checker = SqlChecker(engine, "dedup_old")
    runs = []

    @idempotent(checker, key=lambda n: n, store_result=True)
    def handle(n: int) -> int:
        runs.append(n)
        return n * 10

    with caplog.at_level(logging.WARNING, "msgpatterns.idempotency"):
        assert handle(1) == 10
    assert "ALTER TABLE" in caplog.text and "ADD COLUMN result" in caplog.text
    with pytest.raises(ResultNotStored, match="no result was stored"):
        handle(1)
    assert runs == [1]
    checker.close()
    engine.dispose()
