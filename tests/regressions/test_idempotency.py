"""Idempotency: the holes found from the outside (first collected in issue 10), each
reproduced by a test.

Real servers where it matters (PostgreSQL, MariaDB, Redis: marked tests), every
store where the contract is the store's (closed checkers, hostile keys).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from msgpatterns import Consumer, InMemoryBroker, Message, RetryPolicy
from msgpatterns.errors import ConfigurationError, Reject, StoreUnavailable
from msgpatterns.idempotency import (
    Checker,
    CheckerClosed,
    CheckerSpec,
    MemoryChecker,
    MissingIdempotencyKey,
    RedisChecker,
    SqlChecker,
    TransactionAborted,
    TransactionalSqlChecker,
    idempotent,
)
from msgpatterns.retry import Backoff
from msgpatterns.testing import assert_dead_lettered
from msgpatterns.testing.checker_fixtures import SQL_STORES, STORES, checker_for

QUICK = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(1.0), local_retries=0)
_MARKS = {"redis": [pytest.mark.redis], "postgres": [pytest.mark.postgres],
          "mysql": [pytest.mark.mysql]}
#: Every checker kind on every store it runs on: (store, transactional).
ALL_KINDS = [
    *[pytest.param((s, False), marks=_MARKS.get(s, []), id=s) for s in STORES],
    *[pytest.param((s, True), marks=_MARKS.get(s, []), id=f"tx-{s}") for s in SQL_STORES],
]


class IdlessBroker(InMemoryBroker):
    """An InMemoryBroker whose messages carry no id, as from a foreign publisher that set
    none on a broker that gives none."""

    def fetch(self, topics: Sequence[str], group: str, max_messages: int = 1,
              timeout: float = 0.0) -> list[Message]:
        messages = super().fetch(topics, group, max_messages, timeout)
        for message in messages:
            message.id = None
        return messages


def consume(broker: InMemoryBroker, handler: Any, *, workers: int = 1,
            retry: RetryPolicy = QUICK, fetch_batch: int = 64) -> Consumer:
    consumer = Consumer(broker, handler, topics=["orders"], group="billing",
                        workers=workers, retry=retry, fetch_batch=fetch_batch)
    consumer.run_until_idle(timeout=60)
    return consumer


@pytest.fixture
def any_checker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Checker]:
    store, transactional = request.param
    with checker_for(store, tmp_path, transactional=transactional) as built:
        yield built


# -- Hole 3: async handlers -----------------------------------------------------------------

async def _async_handler(message: Message) -> None:
    raise RuntimeError("never awaited")


class _AsyncCallable:
    async def __call__(self, message: Message) -> None:
        raise RuntimeError("never awaited")


@pytest.mark.parametrize("handler", [
    _async_handler, _AsyncCallable(), functools.partial(_async_handler),
], ids=["async-def", "async-callable-object", "partial-of-async-def"])
def test_async_handler_on_a_sync_checker_is_refused_at_decoration(
        handler: Any, tmp_path: Path) -> None:
    """Hole 3: @idempotent on an async handler used to mark the key DONE as soon as the
    coroutine object was returned, before its body ran. A sync-only checker refuses it
    when decorated, naming the async checker to use."""
    checker = SqlChecker(f"sqlite:///{tmp_path / 'hole3.db'}")
    with pytest.raises(TypeError, match=r"async def.*AsyncSqlChecker.*@idempotent"):
        idempotent(checker)(handler)
    checker.close()


@pytest.mark.parametrize("handler", [
    _async_handler, _AsyncCallable(), functools.partial(_async_handler),
], ids=["async-def", "async-callable-object", "partial-of-async-def"])
def test_a_failing_async_body_is_retried_never_skipped(handler: Any) -> None:
    """Hole 3 closed for good: on an async checker the wrapper awaits the body before
    anything is marked DONE, so a body that fails releases the key and the redelivery
    runs it again (and fails again), never skipped as a duplicate."""
    import asyncio

    checker = MemoryChecker()
    guarded = idempotent(checker)(handler)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="never awaited"):
            asyncio.run(guarded(Message({}, id="m-1")))
    assert checker.stats.completed == 0 and checker.stats.duplicates == 0
    assert checker.stats.claimed == 2 and checker.stats.released == 2


def test_async_key_and_on_duplicate_are_refused() -> None:
    """Hole 3: the key, fingerprint and on_duplicate callables run sync too."""
    async def key(message: Message) -> str:
        return "k"

    with pytest.raises(TypeError, match="async def"):
        idempotent(MemoryChecker(), key=key)
    with pytest.raises(TypeError, match="async def"):
        idempotent(MemoryChecker(), on_duplicate=key)
    with pytest.raises(TypeError, match="async def"):
        idempotent(MemoryChecker(), fingerprint=key)


def test_async_handler_failure_is_not_lost_through_the_consumer() -> None:
    """Hole 3: the user's mistake surfaces before any message is consumed (before the
    fix the first delivery was acked and its failure lost)."""
    broker = InMemoryBroker()
    broker.publish("orders", {"n": 1})
    with pytest.raises(TypeError):
        consume(broker, idempotent(MemoryChecker())(_async_handler))
    assert broker.acked == []


# -- Hole 2: no usable key -------------------------------------------------------------------

def test_message_without_id_or_key_is_dead_lettered_with_how_to_fix() -> None:
    """Hole 2: with neither message.id nor message.key, @idempotent does not guess: the
    message is dead-lettered with a reason saying how to set a key, nothing stored."""
    broker = IdlessBroker()
    broker.publish("orders", {"n": 1})
    broker.publish("orders", {"n": 2}, key="order-2")
    checker = MemoryChecker()
    ran: list[Any] = []

    @idempotent(checker)
    def handle(message: Message) -> None:
        ran.append(message.body["n"])

    consume(broker, handle)
    assert ran == [2]
    (dead,) = assert_dead_lettered(broker, 1, reason="key=")
    assert "message id" in dead.reason
    assert dead.attempts == 1  # a Reject: not retried
    assert len(checker) == 1  # only order-2


@pytest.mark.parametrize("key", [lambda m: None, lambda m: ""], ids=["None", "empty"])
def test_bare_call_without_a_usable_key_raises_a_reject(key: Any) -> None:
    """Hole 2 / Hole 10: a missing (None) or empty key from the default or from the
    key function is a Reject naming how to set a key, and nothing is stored."""
    checker = MemoryChecker()
    calls: list[Message] = []

    def handle(message: Message) -> None:
        calls.append(message)

    for guarded in (idempotent(checker)(handle), idempotent(checker, key=key)(handle)):
        message = Message({"n": 1}, id=None, key=None) if key(None) is None \
            else Message({"n": 1}, id="", key="")
        with pytest.raises(MissingIdempotencyKey) as caught:
            guarded(message)
        assert isinstance(caught.value, Reject)
        assert "key=" in caught.value.reason
    assert calls == []
    assert len(checker) == 0


def test_empty_key_through_the_consumer_is_dead_lettered_not_stored() -> None:
    """Hole 10: an empty key ("") is refused with a reason, never stored."""
    broker = InMemoryBroker()
    broker.publish("orders", {"order_id": ""})
    checker = MemoryChecker()

    @idempotent(checker, key=lambda m: m.body["order_id"])
    def handle(message: Message) -> None:
        raise AssertionError("must not run")

    consume(broker, handle)
    assert_dead_lettered(broker, 1, reason="empty")
    assert len(checker) == 0


# -- Hole 10: misuse at decoration time ------------------------------------------------------

def test_idempotent_without_parentheses_is_a_type_error() -> None:
    """Hole 10: `@idempotent` applied directly to a function used to fail with
    AttributeError: 'function' object has no attribute 'passes_tx'."""
    with pytest.raises(TypeError, match=r"checker.*@idempotent\(checker\)"):
        @idempotent  # type: ignore[arg-type]
        def handle(message: Message) -> None: ...


@pytest.mark.parametrize("bad", ["redis://127.0.0.1:6379/0", object(), None, 42])
def test_idempotent_with_something_not_a_checker_is_a_type_error(bad: Any) -> None:
    """Hole 10: a URL string or any non-checker is refused, naming the argument."""
    with pytest.raises(TypeError, match="checker"):
        idempotent(bad)


def test_idempotent_with_a_url_suggests_building_a_checker() -> None:
    """Hole 10: the URL case says what to do instead, without leaking its password."""
    with pytest.raises(TypeError, match="checker_from_url") as caught:
        idempotent("redis://:s3cret@127.0.0.1:6379/0")  # type: ignore[call-overload]
    assert "s3cret" not in str(caught.value)


@pytest.mark.parametrize("bad", ["order_id", 42])
def test_non_callable_key_is_refused_at_decoration(bad: Any) -> None:
    """Hole 10: key="order_id" used to be accepted and fail once per message."""
    with pytest.raises(ConfigurationError, match="key"):
        idempotent(MemoryChecker(), key=bad)


def test_non_callable_on_duplicate_or_fingerprint_is_refused() -> None:
    """Hole 10: the other callables are checked as well."""
    with pytest.raises(ConfigurationError, match="on_duplicate"):
        idempotent(MemoryChecker(), on_duplicate="ack")  # type: ignore[call-overload]
    with pytest.raises(ConfigurationError, match="fingerprint"):
        idempotent(MemoryChecker(), fingerprint="body")  # type: ignore[call-overload]


def test_transactional_handler_without_tx_is_refused_at_decoration(tmp_path: Path) -> None:
    """Hole 10: a TransactionalSqlChecker handler without a `tx` parameter used to fail
    per call (retried forever under a Consumer); it is refused when decorated."""
    checker = TransactionalSqlChecker(f"sqlite:///{tmp_path / 'tx.db'}")
    try:
        with pytest.raises(ConfigurationError, match="tx"):
            @idempotent(checker)
            def handle(message: Message) -> None: ...

        @idempotent(checker)
        def with_tx(message: Message, tx: Any) -> str:
            return "ran"

        @idempotent(checker)
        def with_kwargs(message: Message, **kwargs: Any) -> str:
            return "ran" if "tx" in kwargs else "no tx"

        assert with_tx(Message({}, id="a")) == "ran"
        assert with_kwargs(Message({}, id="b")) == "ran"
    finally:
        checker.close()


@pytest.mark.parametrize("any_checker", ALL_KINDS, indirect=True)
def test_checker_after_close_raises_a_clear_closed_error(any_checker: Checker) -> None:
    """Hole 10: a checker used to keep working after close() (or fail with a pool or
    driver error): every operation now raises CheckerClosed at once, on every store."""
    tx = isinstance(any_checker, TransactionalSqlChecker)

    @idempotent(any_checker)
    def handle(message: Message, **kwargs: Any) -> None:
        raise AssertionError("must not run after close")

    any_checker.close()
    any_checker.close()  # idempotent
    with pytest.raises(CheckerClosed, match="closed"):
        handle(Message({}, id="m-1"))
    if not tx:
        with pytest.raises(CheckerClosed):
            any_checker.claim("k")
        with pytest.raises(CheckerClosed):
            any_checker.claim_many(["k", "l"])
    with pytest.raises(CheckerClosed):
        any_checker.purge()


# -- Hole 11: a transaction PostgreSQL aborted is not a success -------------------------------

@pytest.fixture
def side_table(sql_url: str, unique: str) -> Iterator[tuple[str, sa.Table]]:
    engine = sa.create_engine(sql_url)
    table = sa.Table(f"side_{unique}", sa.MetaData(),
                     sa.Column("id", sa.String(40), primary_key=True))
    table.create(engine)
    engine.dispose()
    yield sql_url, table
    engine = sa.create_engine(sql_url)
    table.drop(engine)
    engine.dispose()


def test_caught_integrity_error_never_acks_a_rolled_back_transaction(
    side_table: tuple[str, sa.Table], unique: str,
) -> None:
    """Hole 11: the handler inserts, then hits a unique violation and catches the
    IntegrityError. PostgreSQL aborts the transaction and COMMIT silently becomes
    ROLLBACK: the message was acked with no effect and no dedup row. Now an aborted
    transaction is a failure (retried per the policy); SQLite and MariaDB, which keep
    the transaction, commit as before."""
    url, side = side_table
    checker = TransactionalSqlChecker(url, table=f"dedup_{unique}")
    aborts = sa.make_url(url).get_backend_name() == "postgresql"
    broker = InMemoryBroker()
    broker.publish("orders", {"order": "o-1"}, key="o-1")
    attempts: list[int] = []

    @idempotent(checker)
    def handle(message: Message, tx: sa.Connection) -> None:
        attempts.append(message.attempt)
        tx.execute(side.insert().values(id=message.key))
        if message.attempt == 1:
            with contextlib.suppress(sa.exc.IntegrityError):  # the handler "handles" it
                tx.execute(side.insert().values(id=message.key))  # unique violation

    try:
        bare = Message({}, id="bare", key="bare")
        if aborts:
            with pytest.raises(TransactionAborted, match="aborted"):
                handle(bare)
        else:
            handle(bare)
        consume(broker, handle)
        with checker.engine.connect() as conn:
            rows = sorted(conn.scalars(sa.select(side.c.id)))
        assert rows == (["o-1"] if aborts else ["bare", "o-1"])
        assert len(broker.acked) == 1 and broker.dead_letters == []
        assert attempts == ([1, 1, 2] if aborts else [1, 1])
        broker.publish("orders", {"order": "o-1"}, key="o-1")  # committed: a duplicate
        consume(broker, handle)
        assert len(attempts) == (3 if aborts else 2)
    finally:
        checker.store.table.drop()
        checker.close()


# -- Hole 12: a checker never leaks connections of the user's engine -------------------------

@pytest.mark.postgres
def test_sql_checker_on_a_user_engine_survives_backend_kills(
    postgres_url: str, unique: str,
) -> None:
    """Hole 12: SqlChecker switched the user's pooled connections to AUTOCOMMIT; when
    PostgreSQL dropped the session, the reset at check-in raised and the connection
    never returned to the pool, until every worker blocked in QueuePool. Now 300
    messages through 4 workers survive 10 kills of our own backends, and the pool ends
    with nothing checked out."""
    app = f"mp-hole12-{unique}"
    engine = sa.create_engine(postgres_url, pool_size=3, max_overflow=0, pool_timeout=5,
                              connect_args={"application_name": app})
    admin = sa.create_engine(postgres_url, poolclass=sa.pool.NullPool)
    checker = SqlChecker(engine, table=f"dedup_{unique}", lease=30)
    broker = InMemoryBroker()
    for n in range(300):
        broker.publish("orders", {"n": n}, key=f"k-{n}")
    done: Counter[int] = Counter()
    lock = threading.Lock()
    kills: list[int] = []  # backends killed, per kill
    planned = [0]

    def kill_our_backends() -> None:
        with admin.connect() as conn:
            killed = conn.execute(sa.text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = :app"), {"app": app}).scalar_one()
        kills.append(int(killed))

    @idempotent(checker)
    def handle(message: Message) -> None:
        n = message.body["n"]
        with lock:
            done[n] += 1
            kill = n % 30 == 29 and planned[0] < 10
            planned[0] += kill
        if kill:
            kill_our_backends()

    try:
        # Small fetches: the pool reconnects (one batch claim) between two kills.
        consume(broker, handle, workers=4, fetch_batch=4,
                retry=RetryPolicy(max_attempts=50, backoff=Backoff.fixed(1.0)))
        assert set(done) == set(range(300))
        assert broker.pending == 0 and broker.dead_letters == []
        # Every planned kill ran; one can still find the pool between reconnects (no
        # backend to kill), so most, not all, of them must hit.
        assert len(kills) == 10 and sum(1 for k in kills if k) >= 5, kills
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    finally:
        checker.store.table.drop()
        checker.close()
        engine.dispose()
        admin.dispose()


def test_sql_checker_does_not_change_the_user_engines_connections(tmp_path: Path) -> None:
    """Hole 12: no checker changes the characteristics of a connection it does not
    own: the user's engine keeps its isolation level and execution options."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'app.db'}", pool_size=1,
                              poolclass=sa.pool.QueuePool)
    with engine.connect() as conn:
        before = conn.get_isolation_level()
    checker = SqlChecker(engine, table="dedup_user_engine")
    seen: list[str] = []
    connections: set[int] = set()

    @sa.event.listens_for(engine, "engine_connect")
    def on_connect(conn: sa.Connection) -> None:
        connections.add(id(conn.connection.dbapi_connection))
        seen.append(conn.get_execution_options().get("isolation_level", "default"))

    @idempotent(checker)
    def handle(message: Message) -> None: ...

    for n in range(5):
        handle(Message({}, id=f"m-{n}"))
    with engine.connect() as conn:
        assert conn.get_isolation_level() == before
    assert set(seen) == {"default"}
    assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
    checker.close()
    engine.dispose()


# -- Hole 24: credentials never shown ---------------------------------------------------------

@pytest.mark.parametrize("url", [
    "postgresql://app:s3cret@db.example:5432/orders",
    "mysql+pymysql://app:s3cret@db.example/orders",
    "redis://:s3cret@cache.example:6379/0",
    "redis://app:s3cret@cache.example:6379/0",
    "rediss://app:s3cret@cache.example:6380/0?password=s3cret",
])
def test_checker_spec_repr_and_str_redact_the_password(url: str) -> None:
    """Hole 24: repr() of a checker spec used to show the URL password."""
    spec = CheckerSpec("sql", url, {"table": "t"})
    for text in (repr(spec), str(spec), f"{spec}", repr([spec])):
        assert "s3cret" not in text
        assert "***" in text
    assert spec.url == url  # the real URL still travels


def test_every_checker_repr_redacts_the_password(tmp_path: Path) -> None:
    """Hole 24: each checker's repr, and its spec's, hide the URL password."""
    checkers: list[Any] = [
        RedisChecker("redis://:s3cret@127.0.0.1:1/0"),
        RedisChecker("redis://user:s3cret@127.0.0.1:1/0"),
        SqlChecker("postgresql+psycopg://app:s3cret@127.0.0.1:1/orders"),
        TransactionalSqlChecker("postgresql+psycopg://app:s3cret@127.0.0.1:1/orders"),
    ]
    for checker in checkers:
        try:
            for text in (repr(checker), str(checker), repr(checker.spec())):
                assert "s3cret" not in text, text
            assert "127.0.0.1" in repr(checker)
        finally:
            checker.close()


@pytest.mark.parametrize("url", [
    "redis://:s3cret@127.0.0.1:1/0",
    "postgresql+psycopg://app:s3cret@127.0.0.1:1/orders",
])
def test_connection_error_messages_and_logs_redact_the_password(
    url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """Hole 24: an unreachable store's error and logs never show the password."""
    from msgpatterns.idempotency import StorePolicy, checker_from_url

    checker = checker_from_url(url, policy=StorePolicy(attempts=2, wait=0.0, max_wait=0.0))
    caplog.set_level(logging.DEBUG)
    try:
        with pytest.raises(StoreUnavailable) as caught:
            checker.claim("k")
        chain: list[BaseException] = []
        error: BaseException | None = caught.value
        while error is not None:
            chain.append(error)
            error = error.__cause__ or error.__context__
        for text in [*(str(e) for e in chain), *(repr(e) for e in chain), caplog.text]:
            assert "s3cret" not in text
        assert "127.0.0.1" in str(caught.value)
    finally:
        checker.close()


@pytest.mark.parametrize("url", [
    "postgresql://app:s3cret@127.0.0.1:notaport/orders",
    "redis://:s3cret@127.0.0.1:notaport/0",
])
def test_malformed_url_errors_redact_the_password(url: str) -> None:
    """Hole 24: a URL that does not parse is reported without its password."""
    from msgpatterns.idempotency import checker_from_url

    with pytest.raises(ConfigurationError) as caught:
        checker_from_url(url)
    assert "s3cret" not in str(caught.value)


# -- Fuzz: hostile keys on every store ---------------------------------------------------------

def _hostile_keys() -> list[object]:
    long = "k" * 10_000
    return [
        long, long + "x", "k" * 9_999 + "\x00", "x" * 10_240,
        "a", "a\x00", "\x00a", "\x00", "a\x00b", "a\x00c",
        "'", '"', "''", "'; DROP TABLE x; --", '"a"', "\\", "\\'", "%", "_", "a%",
        "*", "?", "[", "]", "[a-z]", "a*", "a?", "*:*", "\\*", "[^a]",
        "{", "}", "{}", "{a}", "{a}b", "a{b}", "{a}{b}", "{{a}}",
        ":", "a:b", "::", "A", "a ", " a", "a\t", "É", "E\u0301", "\u00e9", "e\u0301",
        "\ud800", "\udfff", "sha256:" + "0" * 64, "sha256:", "🔥" * 2_000,
        b"\xff\xfe", b"\xff\xfe\x00", 0, -1, 2**70,
    ]


@pytest.mark.parametrize("any_checker", ALL_KINDS, indirect=True)
def test_hostile_keys_never_collide_nor_corrupt_the_store(any_checker: Checker) -> None:
    """Fuzz: keys of 10 kB, with NUL, quotes, SQL and LIKE syntax, Redis glob (*?[]) and
    hash-tag ({}) syntax, lone surrogates, near-collisions (trailing space, case,
    Unicode normal forms) each act exactly once, and stay DONE, on every store."""
    keys = _hostile_keys()
    texts = [k.decode("utf-8", "surrogateescape") if isinstance(k, bytes) else str(k)
             for k in keys]
    assert len(set(texts)) == len(texts)
    ran: Counter[int] = Counter()

    def call(index: int) -> Any:
        def run(tx: Any) -> None:
            ran[index] += 1
        return run

    for _ in range(2):
        for index, key in enumerate(keys):
            any_checker.execute(key, call(index), group="fuzz")
    assert ran == Counter(range(len(keys)))
    store_keys = [any_checker.store_key(key, "fuzz") for key in keys]
    assert len(set(store_keys)) == len(keys)
    # the other group of the same namespace is untouched by hostile syntax
    assert any_checker.execute("*", call(-1), group="other").ran
    assert ran[-1] == 1
    if not isinstance(any_checker, TransactionalSqlChecker):
        claims = any_checker.claim_many(keys, group="fuzz")
        assert {claim.status.name for claim in claims} == {"DONE"}
