"""Out-of-order events applied exactly once and in order, with VersionGuard.

An order moves created -> paid -> shipped -> delivered; each event carries the
transition as ``expected`` -> ``version``. A price feed carries a timestamp. The
in-memory broker duplicates a third of the deliveries and reorders them, and four
workers handle them concurrently. Still:

* ``VersionGuard.apply`` applies each order transition exactly once and in order:
  a duplicate is skipped, an event that came early raises ``NeedRetry`` and comes back
  later (the order history below is written in the same transaction).
* ``VersionGuard.upsert_latest`` keeps the newest price: an older tick never
  overwrites a newer one.
* An event without a version gets a typed error (``MissingVersion``) and goes to the
  dead-letter store; everything else goes on.

    python examples/ordered_versions.py                 # SQLite in a temporary dir
    python examples/ordered_versions.py --db postgresql+psycopg://postgres@127.0.0.1/test
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from msgpatterns import Backoff, Consumer, InMemoryBroker, Message, RetryPolicy, VersionGuard

ORDERS = 40
STEPS = ["created", "paid", "shipped", "delivered"]
SKUS = 5
TICKS = 12


def build_tables(suffix: str) -> tuple[sa.MetaData, sa.Table, sa.Table, sa.Table]:
    metadata = sa.MetaData()
    orders = sa.Table(
        f"orders_{suffix}", metadata,
        sa.Column("order_id", sa.String(40), primary_key=True),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("version", sa.Integer, nullable=False),
    )
    history = sa.Table(
        f"order_history_{suffix}", metadata,
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("order_id", sa.String(40), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
    )
    prices = sa.Table(
        f"prices_{suffix}", metadata,
        sa.Column("sku", sa.String(20), primary_key=True),
        sa.Column("price", sa.Integer, nullable=False),
        # Double, not Float: MySQL's FLOAT has 24 bits, too few for epoch seconds.
        sa.Column("updated_at", sa.Double, nullable=False),
    )
    return metadata, orders, history, prices


def publish_events(broker: InMemoryBroker) -> None:
    for n in range(ORDERS):
        for version, status in enumerate(STEPS):
            event: dict[str, Any] = {
                "order_id": f"order-{n}", "expected": version - 1 if version else None,
                "version": version, "status": status,
            }
            broker.publish("orders", json.dumps(event), key=f"order-{n}")
    for tick in range(TICKS):
        for s in range(SKUS):
            event = {"sku": f"sku-{s}", "price": 100 + tick, "at": 1_700_000_000.0 + tick / 10}
            broker.publish("prices", json.dumps(event), key=f"sku-{s}")
    # A producer bug: no version. It must end in the dead-letter store, nothing else.
    broker.publish("orders", json.dumps({"order_id": "order-0", "status": "refunded"}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--db", help="SQLAlchemy URL (default: SQLite in a temporary dir)")
    args = parser.parse_args()

    workdir = tempfile.TemporaryDirectory()
    engine = sa.create_engine(args.db or f"sqlite:///{Path(workdir.name) / 'shop.db'}")
    metadata, orders, history, prices = build_tables(uuid.uuid4().hex[:8])
    metadata.create_all(engine)
    order_guard = VersionGuard(orders, key="order_id", version="version")
    price_guard = VersionGuard(prices, key="sku", version="updated_at")
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()

    def handle(message: Message) -> None:
        event: dict[str, Any] = message.body
        with engine.begin() as conn:
            if message.topic == "orders":
                applied = order_guard.apply(
                    conn, event["order_id"], event.get("expected"), event.get("version"),
                    {"status": event["status"]},
                )
                if applied:  # same transaction: the history row commits with the state
                    conn.execute(history.insert().values(
                        order_id=event["order_id"], status=event["status"]))
            else:
                applied = price_guard.upsert_latest(
                    conn, event["sku"], event.get("at"), {"price": event["price"]})
        with lock:
            outcomes[f"{message.topic}: {'applied' if applied else 'skipped (stale)'}"] += 1

    broker = InMemoryBroker(seed=7, duplicate_rate=0.3, reorder_window=8)
    publish_events(broker)
    consumer = Consumer(
        broker, handle, topics=["orders", "prices"], group="projector", workers=4,
        decoder=json.loads,
        retry=RetryPolicy(max_attempts=50, backoff=Backoff.fixed(1.0), local_retries=2),
    )
    try:
        stats = consumer.run_until_idle(timeout=120)

        with engine.connect() as conn:
            states = {r.order_id: (r.status, r.version) for r in conn.execute(sa.select(orders))}
            steps: dict[str, list[str]] = defaultdict(list)
            for r in conn.execute(sa.select(history).order_by(history.c.id)):
                steps[r.order_id].append(r.status)
            newest = {r.sku: r.price for r in conn.execute(sa.select(prices))}
    finally:
        metadata.drop_all(engine)
        engine.dispose()

    print(f"deliveries: {stats.fetched} fetched for {len(broker.published)} published "
          f"(duplicates and redeliveries), {stats.retried_locally} local retries, "
          f"{stats.redelivered} redeliveries of early events")
    for outcome, count in sorted(outcomes.items()):
        print(f"  {outcome}: {count}")
    dead = broker.dead_letters
    for letter in dead:
        print(f"dead letter: {letter.error_type}: {letter.error_message}")

    problems = []
    if states != {f"order-{n}": ("delivered", len(STEPS) - 1) for n in range(ORDERS)}:
        problems.append("not every order is delivered at the last version")
    if any(seen != STEPS for seen in steps.values()) or len(steps) != ORDERS:
        problems.append("an order's history is not each step once, in order")
    if newest != {f"sku-{s}": 100 + TICKS - 1 for s in range(SKUS)}:
        problems.append("a price is not the newest tick")
    if [d.error_type.rsplit(".", 1)[-1] for d in dead] != ["MissingVersion"]:
        problems.append("the event without a version is not the one dead letter")
    if broker.pending:
        problems.append(f"{broker.pending} messages still pending")
    if problems:
        print("final table check: FAILED:", "; ".join(problems))
        return 1
    print(f"final table check: OK - {ORDERS} orders delivered, each step applied once and "
          f"in order; {SKUS} prices at their newest tick; 1 dead letter")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
