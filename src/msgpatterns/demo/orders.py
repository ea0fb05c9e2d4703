"""``msgpatterns demo``: an order-status pipeline that survives a misbehaving broker.

Orders move ``created -> paid -> shipped -> delivered`` (versions 1..4). Their events
go through an :class:`~msgpatterns.InMemoryBroker` that duplicates, reorders and loses
acks (seeded), plus a few malformed messages. The handler:

* decodes JSON (a bad body is a ``MalformedMessage``: dead-lettered, the consumer goes on),
* applies the transition with :class:`~msgpatterns.VersionGuard` (an early event raises
  ``NeedRetry``: retried locally, then later),
* records each payment in a ledger table, inside the same transaction as the dedup row
  of :class:`~msgpatterns.TransactionalSqlChecker` (a duplicate is skipped, never paid
  twice).

At the end the database is checked against the state the events imply: it must be
exact. Runs on SQLite by default (``--db`` takes any SQLAlchemy URL).
"""

from __future__ import annotations

import json
import logging
import random
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from msgpatterns.brokers.memory.broker import InMemoryBroker
from msgpatterns.consumer import Consumer
from msgpatterns.demo.console import STEPS, Console, DemoResult
from msgpatterns.errors import MalformedMessage
from msgpatterns.message import Message
from msgpatterns.retry import Backoff, RetryPolicy

__all__ = ["TOPIC", "build_handler", "parse_event", "run_demo"]

TOPIC = "orders.status"


# -- the business handler --------------------------------------------------------------


def parse_event(body: Any) -> dict[str, Any]:
    """Decode and validate one order event; a bad one is a MalformedMessage."""
    try:
        event = json.loads(body)
    except (TypeError, ValueError) as exc:
        raise MalformedMessage(f"body is not JSON: {exc}") from exc
    if not isinstance(event, dict):
        raise MalformedMessage("body is not a JSON object")
    missing = [f for f in ("order_id", "status", "version") if f not in event]
    if missing:
        raise MalformedMessage(f"missing field(s): {', '.join(missing)}")
    if event["status"] not in STEPS or not isinstance(event["version"], int):
        raise MalformedMessage(f"bad status/version: {event['status']!r} {event['version']!r}")
    return event


Handler = Callable[[Message], Any]


def build_handler(
    db_url: str, prefix: str = "demo_"
) -> tuple[Handler, Callable[[], dict[str, Any]], Callable[[], dict[str, int]]]:
    """The idempotent, version-guarded handler, a reader of the final state, and stats."""
    import sqlalchemy as sa

    from msgpatterns.idempotency import TransactionalSqlChecker, idempotent
    from msgpatterns.ordering import VersionGuard

    engine = sa.create_engine(db_url)
    if engine.dialect.name == "sqlite":  # a scratch file: durability is not the point here
        @sa.event.listens_for(engine, "connect")
        def _fast_sqlite(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.execute("PRAGMA journal_mode=WAL")
            dbapi_conn.execute("PRAGMA synchronous=OFF")

    meta = sa.MetaData()
    orders = sa.Table(
        f"{prefix}orders", meta,
        sa.Column("order_id", sa.String(64), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
    )
    payments = sa.Table(  # deliberately no unique key: a duplicate would pay twice
        f"{prefix}payments", meta,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("order_id", sa.String(64), nullable=False),
        sa.Column("amount_cents", sa.Integer, nullable=False),
    )
    meta.drop_all(engine)
    meta.create_all(engine)
    checker = TransactionalSqlChecker(engine, table=f"{prefix}dedup")
    checker.create_table()
    checker.purge(older_than=0)  # a fresh run on a reused database
    guard = VersionGuard(orders, key="order_id", version="version")
    stale = [0]

    @idempotent(checker, key=lambda m: f"{m.body['order_id']}:v{m.body['version']}",
                group="demo.order-status")
    def apply_event(message: Message, tx: sa.Connection) -> None:
        event = message.body
        version = event["version"]
        applied = guard.apply(
            tx, event["order_id"], expected=version - 1 if version > 1 else None,
            new=version, values={"status": event["status"]},
        )
        if not applied:
            stale[0] += 1
        elif event["status"] == "paid":
            tx.execute(payments.insert().values(
                order_id=event["order_id"], amount_cents=event["amount_cents"]
            ))

    def handle(message: Message) -> None:
        message.body = parse_event(message.raw_body)
        apply_event(message)

    def final_state() -> dict[str, Any]:
        with engine.connect() as conn:
            rows = {r.order_id: (r.status, r.version) for r in conn.execute(sa.select(orders))}
            paid: dict[str, list[int]] = {}
            for r in conn.execute(sa.select(payments)):
                paid.setdefault(r.order_id, []).append(r.amount_cents)
        return {"orders": rows, "payments": paid}

    def stats() -> dict[str, int]:
        return {"skipped_duplicates": checker.stats.duplicates, "stale_versions": stale[0]}

    return handle, final_state, stats


# -- the run ---------------------------------------------------------------------------


def _publish(broker: InMemoryBroker, orders: int, malformed: int,
             rng: random.Random) -> dict[str, Any]:
    """Publish every order's events (interleaved) and the malformed ones; return the
    expected final state."""
    expected_orders: dict[str, tuple[str, int]] = {}
    expected_paid: dict[str, int] = {}
    plans = []
    for n in range(orders):
        order_id = f"order-{n:05d}"
        steps = rng.randint(1, len(STEPS))  # some orders stop early
        amount = rng.randint(100, 100_000)
        plans.append((order_id, steps, amount))
        expected_orders[order_id] = (STEPS[steps - 1], steps)
        if steps >= 2:
            expected_paid[order_id] = amount
    bad_at = set(rng.sample(range(max(orders, 1)), k=min(malformed, orders)))
    wave = 8  # orders published together, so the broker's reordering mixes their steps
    for first in range(0, len(plans), wave):
        group = list(enumerate(plans))[first:first + wave]
        for version in range(1, len(STEPS) + 1):
            for n, (order_id, steps, amount) in group:
                if version <= steps:
                    event = {"order_id": order_id, "status": STEPS[version - 1],
                             "version": version, "amount_cents": amount}
                    broker.publish(TOPIC, json.dumps(event).encode(), key=order_id)
                if version == 1 and n in bad_at:
                    broker.publish(TOPIC, b'{"order_id": "broken", "status": ', key="broken")
    return {"orders": expected_orders, "payments": expected_paid}


def _check(expected: dict[str, Any], actual: dict[str, Any], broker: InMemoryBroker,
           malformed: int) -> list[str]:
    problems = []
    wrong = [k for k, v in expected["orders"].items() if actual["orders"].get(k) != v]
    if wrong:
        problems.append(f"{len(wrong)} order(s) in the wrong state, e.g. {wrong[:3]}")
    extra = set(actual["orders"]) - set(expected["orders"])
    if extra:
        problems.append(f"unexpected orders: {sorted(extra)[:3]}")
    twice = [k for k, v in actual["payments"].items() if len(v) > 1]
    if twice:
        problems.append(f"{len(twice)} order(s) paid more than once, e.g. {twice[:3]}")
    paid = {k: v[0] for k, v in actual["payments"].items()}
    if paid != expected["payments"]:
        problems.append("the payment ledger differs from the expected one")
    if broker.pending:
        problems.append(f"{broker.pending} message(s) still pending")
    dead = {d.id for d in broker.dead_letters}  # a duplicate of a dead message dies too
    if len(dead) != malformed:
        problems.append(f"{len(dead)} dead message(s), expected {malformed}")
    return problems


def _settled(broker: InMemoryBroker) -> int:
    return len({m.id for m in broker.acked} | {d.id for d in broker.dead_letters})


def run_demo(
    *,
    orders: int = 500,
    malformed: int = 3,
    duplicate_rate: float = 0.1,
    reorder_window: int = 32,
    lost_ack_rate: float = 0.05,
    seed: int = 7,
    workers: int = 4,
    db: str | None = None,
    progress: bool = True,
    out: Callable[[str], None] | None = None,
    table_prefix: str = "demo_",
) -> DemoResult:
    """Run the pipeline and print a summary; the result says whether it was exact."""
    console = Console(out)
    rng = random.Random(seed)
    broker = InMemoryBroker(
        seed=seed, duplicate_rate=duplicate_rate, reorder_window=reorder_window,
        lost_ack_rate=lost_ack_rate, visibility_timeout=60,
    )
    workdir = tempfile.TemporaryDirectory(prefix="msgpatterns-demo-")
    db_url = db or f"sqlite:///{Path(workdir.name) / 'demo.db'}"
    handle, final_state, handler_stats = build_handler(db_url, table_prefix)
    expected = _publish(broker, orders, malformed, rng)
    published = len(broker.published)

    consumer = Consumer(
        broker, handle, topics=[TOPIC], group="order-status", workers=workers,
        retry=RetryPolicy(max_attempts=16, backoff=Backoff.rocketmq(), local_retries=2,
                          local_backoff=Backoff.fixed(0.001)),
    )
    virtual_start, wall_start = broker.now(), time.perf_counter()
    errors: list[BaseException] = []

    def drive() -> None:
        try:
            consumer.run_until_idle(timeout=600)
        except BaseException as exc:  # reported below
            errors.append(exc)

    runner = threading.Thread(target=drive, name="msgpatterns-demo")
    quiet = logging.getLogger("msgpatterns")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # dead letters are listed in the summary instead
    runner.start()
    console.progress(runner, lambda: _settled(broker), published, enabled=progress)
    runner.join()
    quiet.setLevel(level)
    wall = time.perf_counter() - wall_start
    if errors:
        raise errors[0]

    stats = broker.stats
    extra = handler_stats()
    summary = {
        "published": published,
        "deliveries": stats.delivered,
        "duplicates injected": stats.duplicates,
        "acks lost (redelivered later)": stats.lost_acks,
        "retries in-process": consumer.stats.retried_locally,
        "delayed retries": consumer.stats.redelivered,
        "duplicates skipped (idempotency)": extra["skipped_duplicates"],
        "stale versions skipped": extra["stale_versions"],
        "dead letters (malformed input)": len({d.id for d in broker.dead_letters}),
        "virtual time elapsed": f"{broker.now() - virtual_start:,.0f} s",
        "wall time": f"{wall:.2f} s",
    }
    problems = _check(expected, final_state(), broker, malformed)
    result = DemoResult(published, malformed, summary, problems)
    firsts = {d.id: d for d in broker.dead_letters}
    console.summary(result, expected, [f"{d.message.body!r}: {d.reason}"
                                       for d in list(firsts.values())[:3]])
    workdir.cleanup()
    return result
