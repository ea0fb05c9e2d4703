"""Generated schedules: every checker and guard through ``Consumer``, under duplicates,
reordering, lost acks, crashes at every step boundary, transient store errors and 1 or
4 workers. The transactional paths show 0 lost and 0 doubled; the lease checkers 0
lost and exactly one double per crash between the effect and the DONE mark (their
documented window, docs/idempotency.md). Totals per combination are printed at the
end of the session (``reliability: ...`` lines); ``MSGPATTERNS_SOAK=soak`` (``make
soak``) runs the big profile.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_harness import (
    POINTS,
    Outcome,
    Run,
    Schedule,
    examples,
    record,
    run_schedule,
)

from msgpatterns import idempotent
from msgpatterns.idempotency import (
    MemoryChecker,
    RedisChecker,
    SqlChecker,
    StorePolicy,
    TransactionalSqlChecker,
)
from msgpatterns.idempotency.base import LeaseChecker
from msgpatterns.idempotency.guard import Io
from msgpatterns.message import Message
from msgpatterns.ordering import VersionGuard
from msgpatterns.testing import services

ATTEMPTS = 3
STORE_POLICY = StorePolicy(attempts=ATTEMPTS, wait=0.0, max_wait=0.0, unavailable_delay=5.0)
LEASE = 30.0  # < the broker's visibility timeout (60 s): a crashed claim has expired
TTL = 10_000_000.0  # far beyond the virtual time a schedule spends

schedules = st.builds(
    Schedule,
    keys=st.integers(1, 10),
    max_copies=st.integers(1, 5),
    duplicate_rate=st.sampled_from([0.0, 0.1, 0.2]),  # + 1-5 copies per key published
    reorder_window=st.integers(0, 8),
    lost_ack_rate=st.sampled_from([0.0, 0.1, 0.3]),
    crash_rate=st.sampled_from([0.0, 0.1, 0.3, 0.5]),
    crash_points=st.frozensets(st.sampled_from(POINTS)),
    transient_rate=st.sampled_from([0.0, 0.2, 0.4]),
    seed=st.integers(0, 2**32 - 1),
)


def profile(weight: float) -> settings:
    return settings(
        max_examples=examples(weight), deadline=None, database=None, print_blob=True,
        suppress_health_check=list(HealthCheck),
    )


@pytest.fixture(autouse=True)
def quiet_logs() -> Iterator[None]:
    """Crashes and injected store errors are expected here: keep the logs to errors."""
    logger = logging.getLogger("msgpatterns")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


def check(combination: str, outcome: Outcome, *, window: bool) -> None:
    """Record the totals, then assert: nothing pending or dead, nothing lost, and the
    doubles the combination allows - exactly one per after-write crash of each key when
    ``window`` (a lease checker), none otherwise."""
    record(combination, outcome)
    detail = outcome.describe()
    assert outcome.pending == 0, detail
    assert outcome.dead_letters == 0, detail
    assert outcome.lost == 0, detail
    if window:
        for key in outcome.keys:
            assert outcome.effects[key] == 1 + outcome.expected_doubles[key], detail
        assert outcome.doubled == sum(outcome.expected_doubles.values()), detail
    else:
        assert outcome.doubled == 0, detail


def injected_sql_error() -> BaseException:
    return sa.exc.OperationalError("injected", None, Exception("injected transient error"))


# -- lease checkers ---------------------------------------------------------------------


def lease_handler(
    run: Run, checker: LeaseChecker, *, expire: Callable[[str], None] | None = None,
    make_error: Callable[[], BaseException] | None = None,
) -> tuple[Callable[[Message], Any], Callable[[], collections.Counter[str]]]:
    """A handler whose effect is outside the store (a counter: think HTTP call).

    A crash leaves the claim PROCESSING: the dead process releases nothing. Its lease
    then expires - on the broker's virtual clock for Memory/SQL, by ``expire`` (the
    store's own clock jumping) for Redis - before the broker redelivers.
    """
    plan = run.plan
    effects: collections.Counter[str] = collections.Counter()
    lock = threading.Lock()
    transient = run.transient(make_error or (lambda: checker.transient[0]("injected")))
    store = checker.store
    transient.wrap(store, "claim_many")
    transient.wrap(store, "complete_many", cap=ATTEMPTS - 1)  # completion succeeds
    transient.wrap(store, "release_many")
    perform = checker._perform  # every store operation the guard asks for

    def release_unless_crashed(io: Io) -> Any:
        if io.op == "release_many" and plan.take_crashing():
            if expire is not None:
                for item in io.arg:
                    expire(item.key)
            return [False] * len(io.arg)
        return perform(io)

    checker._perform = release_unless_crashed  # type: ignore[method-assign]

    @idempotent(checker, group="g")
    def handle(message: Message) -> None:
        point = plan.decide()
        if point == "before_write":
            plan.crash(message, point)
        with lock:
            effects[str(message.key)] += 1
        if point == "after_write":
            plan.crash(message, point)
        if point == "after_complete":
            plan.lose_ack(message)

    return handle, lambda: effects


def memory_checker(run: Run) -> MemoryChecker:
    checker = MemoryChecker(ttl=TTL, lease=LEASE, clock=run.broker.now)
    checker.store.transient = (ConnectionError,)  # the fault injected below, retried like a store's
    checker.policy = STORE_POLICY
    return checker


WORKERS = pytest.mark.parametrize("workers", [1, 4])


@WORKERS
def test_memory_checker(workers: int) -> None:
    @profile(2.0)
    @given(schedule=schedules)
    def prop(schedule: Schedule) -> None:
        outcome = run_schedule(schedule, workers,
                               lambda run: lease_handler(run, memory_checker(run)))
        check(f"MemoryChecker workers={workers}", outcome, window=True)

    prop()


def fast_sqlite(url: str) -> sa.Engine:
    """A SQLite engine without fsync (WAL, synchronous=OFF): crashes here are simulated,
    the OS never goes down, and thousands of schedules stay fast."""
    engine = sa.create_engine(url, connect_args={"timeout": 5})

    @sa.event.listens_for(engine, "connect")
    def pragmas(dbapi_connection: Any, record: Any) -> None:
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=OFF")
        cursor.close()

    return engine


@pytest.fixture(scope="module")
def sqlite_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sa.Engine]:
    path = tmp_path_factory.mktemp("reliability") / "schedules.db"
    engine = fast_sqlite(f"sqlite:///{path}")
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def postgres_engine() -> Iterator[sa.Engine]:
    engine = sa.create_engine(services.require("postgres"), pool_size=8,
                              connect_args={"application_name": "msgpatterns-reliability"})
    yield engine
    engine.dispose()


def drop(engine: sa.Engine, *names: str) -> None:
    with engine.begin() as conn:
        for name in names:
            conn.execute(sa.text(f'DROP TABLE IF EXISTS "{name}"'))


def sql_run(engine: sa.Engine, table: str) -> Callable[[Run], Any]:
    def build(run: Run) -> Any:
        checker = SqlChecker(engine, table=table, ttl=TTL, lease=LEASE,
                             namespace=f"n{run.id}", policy=STORE_POLICY,
                             clock=run.broker.now)
        return lease_handler(run, checker, make_error=injected_sql_error)

    return build


@WORKERS
def test_sql_checker_sqlite(workers: int, sqlite_engine: sa.Engine) -> None:
    table = f"dedup_sql_{workers}"

    @profile(1.5)
    @given(schedule=schedules)
    def prop(schedule: Schedule) -> None:
        outcome = run_schedule(schedule, workers, sql_run(sqlite_engine, table))
        check(f"SqlChecker/sqlite workers={workers}", outcome, window=True)

    prop()


@pytest.mark.postgres
@WORKERS
def test_sql_checker_postgres(workers: int, postgres_engine: sa.Engine, unique: str) -> None:
    table = f"rel_sql_{unique}"

    @profile(0.3)
    @given(schedule=schedules)
    def prop(schedule: Schedule) -> None:
        outcome = run_schedule(schedule, workers, sql_run(postgres_engine, table))
        check(f"SqlChecker/postgres workers={workers}", outcome, window=True)

    try:
        prop()
    finally:
        drop(postgres_engine, table)


def redis_run(make_client: Callable[[], Any]) -> Callable[[Run], Any]:
    client = make_client()

    def build(run: Run) -> Any:
        checker = RedisChecker(client, namespace=f"rel{run.id}", ttl=3600, lease=LEASE,
                               policy=STORE_POLICY)
        # The crashed owner's lease runs on the Redis server's clock: let it expire.
        return lease_handler(run, checker, expire=lambda key: client.pexpire(key, 1))

    return build


@WORKERS
def test_redis_checker_fakeredis(workers: int) -> None:
    fakeredis = pytest.importorskip("fakeredis")
    server = fakeredis.FakeServer()
    build = redis_run(lambda: fakeredis.FakeRedis(server=server))

    @profile(1.5)
    @given(schedule=schedules)
    def prop(schedule: Schedule) -> None:
        outcome = run_schedule(schedule, workers, build)
        check(f"RedisChecker/fakeredis workers={workers}", outcome, window=True)

    prop()


@pytest.mark.redis
@WORKERS
def test_redis_checker_redis(workers: int) -> None:
    import redis

    url = services.require("redis")
    build = redis_run(lambda: redis.Redis.from_url(url, client_name="msgpatterns-reliability"))

    @profile(0.4)
    @given(schedule=schedules)
    def prop(schedule: Schedule) -> None:
        outcome = run_schedule(schedule, workers, build)
        check(f"RedisChecker/redis workers={workers}", outcome, window=True)

    prop()


# -- the transactional path ---------------------------------------------------------------


def effects_table(name: str) -> sa.Table:
    return sa.Table(name, sa.MetaData(), sa.Column("run", sa.String(32), nullable=False),
                    sa.Column("item", sa.String(64), nullable=False))


def read_effects(engine: sa.Engine, table: sa.Table, run: str) -> collections.Counter[str]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(table.c.item, sa.func.count()).where(table.c.run == run)
            .group_by(table.c.item)
        ).all()
    return collections.Counter(dict(rows))


def transactional_run(engine: sa.Engine, dedup: str, effects: sa.Table) -> Callable[[Run], Any]:
    """The handler writes its effect through ``tx``: a crash before the commit rolls
    the effect and the dedup row back together."""

    def build(run: Run) -> Any:
        plan = run.plan
        checker = TransactionalSqlChecker(engine, table=dedup, ttl=TTL,
                                          namespace=f"n{run.id}", policy=STORE_POLICY)
        run.transient(injected_sql_error).wrap(checker.store, "begin")

        @idempotent(checker, group="g")
        def handle(message: Message, tx: sa.Connection) -> None:
            point = plan.decide()
            if point == "before_write":
                plan.crash(message, point)
            tx.execute(effects.insert().values(run=run.id, item=str(message.key)))
            if point == "after_write":
                plan.crash(message, point)  # the open transaction dies with the process
            if point == "after_complete":
                plan.lose_ack(message)

        return handle, lambda: read_effects(engine, effects, run.id)

    return build


@WORKERS
def test_transactional_sqlite(workers: int, sqlite_engine: sa.Engine) -> None:
    effects = effects_table(f"effects_tx_{workers}")
    effects.create(sqlite_engine)
    build = transactional_run(sqlite_engine, f"dedup_tx_{workers}", effects)

    @profile(2.0)
    @given(schedule=schedules)
    def prop(schedule: Schedule) -> None:
        outcome = run_schedule(schedule, workers, build)
        check(f"TransactionalSqlChecker/sqlite workers={workers}", outcome, window=False)

    prop()


@pytest.mark.postgres
@WORKERS
def test_transactional_postgres(workers: int, postgres_engine: sa.Engine, unique: str) -> None:
    effects = effects_table(f"rel_fx_{unique}")
    effects.create(postgres_engine)
    build = transactional_run(postgres_engine, f"rel_tx_{unique}", effects)

    @profile(0.5)
    @given(schedule=schedules)
    def prop(schedule: Schedule) -> None:
        outcome = run_schedule(schedule, workers, build)
        check(f"TransactionalSqlChecker/postgres workers={workers}", outcome, window=False)

    try:
        prop()
    finally:
        drop(postgres_engine, effects.name, f"rel_tx_{unique}")


# -- VersionGuard ---------------------------------------------------------------------------


Publishes = list[tuple[str, dict[str, Any], str]]


def versions_workload(schedule: Schedule) -> tuple[list[str], Publishes]:
    """Entities with versions 1..3; each version's message sent 1..3 times.
    The keys that must show exactly one effect: every transition ``entity:version``."""
    rng = random.Random(schedule.seed)
    keys: list[str] = []
    publishes: list[tuple[str, dict[str, Any], str]] = []
    for e in range((schedule.keys + 1) // 2):  # up to 5 entities, 3 versions, 3 copies
        entity = f"e{e}"
        latest = rng.randint(1, 3)
        for version in range(1, latest + 1):
            keys.append(f"{entity}:{version}")
            body = {"entity": entity, "version": version, "latest": latest}
            mid = f"{entity}-{version}-{rng.getrandbits(32):x}"
            for _ in range(rng.randint(1, min(schedule.max_copies, 3))):
                publishes.append((entity, body, mid))
    rng.shuffle(publishes)
    return keys, publishes


def latest_workload(schedule: Schedule) -> tuple[list[str], Publishes]:
    """As :func:`versions_workload`; only each entity's latest version must be written
    (older ones may be skipped when they arrive late: latest wins)."""
    _, publishes = versions_workload(schedule)
    latest = {body["entity"]: body["latest"] for _, body, _ in publishes}
    return [f"{e}:{v}" for e, v in sorted(latest.items())], publishes


def guard_run(engine: sa.Engine, guard: VersionGuard, effects: sa.Table, *,
              strict: bool) -> Callable[[Run], Any]:
    """The handler applies the message's version through the guard and records the
    effect in the same transaction when the guard wrote. Transient errors: the
    database refuses the connection (the handler fails, the message is redelivered)."""

    def build(run: Run) -> Any:
        plan = run.plan
        transient = run.transient(injected_sql_error)

        def handle(message: Message) -> None:
            body = message.body
            version = body["version"]
            point = plan.decide()
            if point == "before_write":
                plan.crash(message, point)
            transient.maybe_fail("begin")
            with engine.begin() as conn:
                key = (run.id, body["entity"])
                if strict:
                    wrote = guard.apply(conn, key, version - 1 or None, version,
                                        {"value": f"v{version}"})
                else:
                    wrote = guard.upsert_latest(conn, key, version, {"value": f"v{version}"})
                if wrote:
                    conn.execute(effects.insert().values(
                        run=run.id, item=f"{body['entity']}:{version}"))
                if point == "after_write":
                    plan.crash(message, point)  # before the commit: rolled back
            if point == "after_complete":
                plan.lose_ack(message)

        def effects_and_state() -> collections.Counter[str]:
            found = read_effects(engine, effects, run.id)
            with engine.connect() as conn:
                rows = conn.execute(sa.select(guard.table.c.entity, guard.table.c.version)
                                    .where(guard.table.c.run == run.id)).all()
            stored = dict(rows)
            for item in list(found):
                entity, version = item.split(":")
                if stored.get(entity) is None or stored[entity] < int(version):
                    found[item] = 0  # an applied version that did not stick: lost
            return found

        return handle, effects_and_state

    return build


def versions_table(name: str) -> sa.Table:
    return sa.Table(name, sa.MetaData(),
                    sa.Column("run", sa.String(32), primary_key=True),
                    sa.Column("entity", sa.String(32), primary_key=True),
                    sa.Column("version", sa.Integer),
                    sa.Column("value", sa.String(32)))


@pytest.mark.parametrize("mode", ["upsert_latest", "apply"])
@WORKERS
def test_version_guard_sqlite(mode: str, workers: int, sqlite_engine: sa.Engine) -> None:
    table = versions_table(f"versions_{mode}_{workers}")
    effects = effects_table(f"effects_{mode}_{workers}")
    table.create(sqlite_engine)
    effects.create(sqlite_engine)
    build = guard_run(sqlite_engine, VersionGuard(table, ["run", "entity"], "version"),
                      effects, strict=mode == "apply")
    workload = versions_workload if mode == "apply" else latest_workload

    @profile(1.0)
    @given(schedule=schedules)
    def prop(schedule: Schedule) -> None:
        outcome = run_schedule(schedule, workers, build, messages=workload)
        check(f"VersionGuard.{mode}/sqlite workers={workers}", outcome, window=False)

    prop()


def test_profile_reaches_the_required_schedule_count() -> None:
    """The ci profile runs >= 2,000 schedules in all; soak >= 100,000."""
    weights = 2 * (2.0 + 1.5 + 0.3 + 1.5 + 0.4 + 2.0 + 0.5 + 1.0 + 1.0)
    from reliability_harness import PROFILES

    assert PROFILES["ci"] * weights >= 2000
    assert PROFILES["soak"] * weights >= 100_000



def test_harness_detects_an_effect_outside_the_transaction(sqlite_engine: sa.Engine) -> None:
    """The harness can fail: a TransactionalSqlChecker handler whose effect is not
    written through ``tx`` (here: a counter, think an HTTP call) is at-least-once, and
    the schedule counts one double per crash after the effect - what the transactional
    assertion (doubled == 0) rejects."""

    def build(run: Run) -> Any:
        plan = run.plan
        effects: collections.Counter[str] = collections.Counter()
        checker = TransactionalSqlChecker(sqlite_engine, table="dedup_outside_tx",
                                          namespace=f"n{run.id}", policy=STORE_POLICY)

        @idempotent(checker, group="g")
        def handle(message: Message, tx: sa.Connection) -> None:
            effects[str(message.key)] += 1  # the mistake: not through tx
            if plan.decide() is not None:
                plan.crash(message, "after_write")

        return handle, lambda: effects

    schedule = Schedule(keys=6, max_copies=1, duplicate_rate=0.0, reorder_window=0,
                        lost_ack_rate=0.0, crash_rate=0.5,
                        crash_points=frozenset({"after_write"}), transient_rate=0.0, seed=7)
    outcome = run_schedule(schedule, 1, build)
    assert outcome.lost == 0
    assert outcome.doubled == sum(outcome.expected_doubles.values()) > 0
