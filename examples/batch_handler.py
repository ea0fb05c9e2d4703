"""A batch handler: price ticks written per batch, idempotent per message.

``Consumer(..., batch=True)`` hands the handler a list of messages (what one fetch
brought, up to ``fetch_batch``); every message is still settled on its own:

* ``@idempotent(checker)`` on the batch handler claims the batch's keys in ONE store
  round trip and completes them in ONE after the handler returned (DONE before the
  acks). Duplicates never reach the handler: it gets only the messages it must apply.
* ``VersionGuard.upsert_latest_many`` writes the batch's newest price per SKU in one
  statement: an older tick (the broker reorders) never overwrites a newer one.
* A tick that cannot be parsed fails alone with ``PartialFailure`` (a ``Reject``: it is
  dead-lettered); a tick whose SKU is "locked" the first time fails alone with a
  transient error and is redelivered alone; the rest of its batch is acked.
* A ``Flusher`` writes the audit trail across batches: the handler takes over the ack
  of each applied tick (``disable_auto_ack``) and the Flusher acks it once its audit row
  commits - and only then is its idempotency key completed (a duplicate arriving
  meanwhile is told ``InProgress`` and comes back later, to be skipped).

    python examples/batch_handler.py
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from msgpatterns import (
    Backoff,
    Consumer,
    Flusher,
    InMemoryBroker,
    Message,
    Reject,
    RetryPolicy,
    VersionGuard,
)
from msgpatterns.errors import PartialFailure
from msgpatterns.idempotency import SqlChecker, idempotent

SKUS = 20
TICKS_PER_SKU = 10


def tables() -> tuple[sa.MetaData, sa.Table, sa.Table]:
    metadata = sa.MetaData()
    prices = sa.Table(
        "prices", metadata,
        sa.Column("sku", sa.String(20), primary_key=True),
        sa.Column("price", sa.Integer, nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
    )
    audit = sa.Table(
        "price_audit", metadata,
        sa.Column("tick_id", sa.String(40), primary_key=True),
        sa.Column("sku", sa.String(20), nullable=False),
    )
    return metadata, prices, audit


def main() -> int:
    workdir = Path(tempfile.mkdtemp(prefix="msgpatterns-batch-"))
    engine = sa.create_engine(f"sqlite:///{workdir / 'prices.db'}")
    metadata, prices, audit = tables()
    metadata.create_all(engine)
    guard = VersionGuard(prices, key="sku", version="seq")
    checker = SqlChecker(engine, "ticks_dedup")

    broker = InMemoryBroker(seed=11, duplicate_rate=0.2, reorder_window=8)
    for seq in range(TICKS_PER_SKU):
        for sku in range(SKUS):
            tick = {"sku": f"sku-{sku}", "price": 100 + seq, "seq": seq}
            broker.publish("ticks", json.dumps(tick).encode(), id=f"sku-{sku}/{seq}")
    broker.publish("ticks", b'{"sku": "sku-0", "price": "n/a"}', id="bad-tick")

    locked_once: set[str] = set()
    lock = threading.Lock()

    def write_audit(batch: list[Message]) -> None:  # one transaction per Flusher batch
        with engine.begin() as conn:
            conn.execute(sa.insert(audit).prefix_with("OR IGNORE"),
                         [{"tick_id": m.id, "sku": m.body["sku"]} for m in batch])

    with Flusher("audit", batch_size=50, flush_interval=0.02, queue_size=1000, threads=1,
                 processor=write_audit, ack_messages=True) as flusher:

        @idempotent(checker, group="prices.batch")
        def handle(ticks: list[Message]) -> None:
            failures: dict[Message, BaseException] = {}
            rows: list[dict[str, Any]] = []
            for tick in ticks:
                body = tick.body
                if not isinstance(body.get("price"), int):
                    failures[tick] = Reject(f"unparseable price {body.get('price')!r}")
                    continue
                with lock:
                    first_time = body["sku"] == "sku-7" and tick.id not in locked_once
                    locked_once.add(tick.id or "")
                if first_time:  # a transient error for this tick only
                    failures[tick] = TimeoutError("row lock wait timeout")
                    continue
                rows.append({"sku": body["sku"], "price": body["price"], "seq": body["seq"]})
            with engine.begin() as conn:  # the batch's newest price per SKU, one statement
                guard.upsert_latest_many(conn, rows)
            for tick in ticks:
                if tick not in failures:
                    tick.disable_auto_ack()  # acked by the Flusher once audited
                    flusher.add(tick, timeout=5.0)
            if failures:
                raise PartialFailure(failures)

        consumer = Consumer(
            broker, handle, topics=["ticks"], group="prices", batch=True, fetch_batch=64,
            decoder=json.loads,
            retry=RetryPolicy(max_attempts=5, backoff=Backoff.fixed(1.0), local_retries=0),
        )
        consumer.run_until_idle(timeout=60)  # in production: consumer.run()

    with engine.connect() as conn:
        latest = dict(conn.execute(sa.select(prices.c.sku, prices.c.seq)).all())
        audited = conn.execute(sa.select(sa.func.count()).select_from(audit)).scalar_one()
    stats, dedup = consumer.stats, checker.stats
    dead = Counter(d.message.id for d in broker.dead_letters)
    print(f"ticks published:  {SKUS * TICKS_PER_SKU + 1} "
          f"({broker.stats.duplicates} duplicate deliveries)")
    print(f"batches:          claims {dedup.claimed}, duplicates skipped {dedup.duplicates}")
    print(f"settled:          acked {stats.acked}, redelivered {stats.redelivered}, "
          f"dead-lettered {stats.dead_lettered} {sorted(dead)}")
    print(f"prices:           {len(latest)} SKUs, newest seq everywhere: "
          f"{set(latest.values()) == {TICKS_PER_SKU - 1}}")
    print(f"audit rows:       {audited}")
    ok = (latest == {f"sku-{s}": TICKS_PER_SKU - 1 for s in range(SKUS)}
          and audited == SKUS * TICKS_PER_SKU and list(dead) == ["bad-tick"]
          and broker.pending == 0 and dedup.claimed == SKUS * TICKS_PER_SKU + 1
          + len(locked_once & {f"sku-7/{s}" for s in range(TICKS_PER_SKU)}))
    print("every tick applied once, newest prices kept, the bad tick dead-lettered"
          if ok else "SOMETHING WENT WRONG")
    checker.close()
    engine.dispose()
    return 0 if ok else 1


if __name__ == "__main__":
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("msgpatterns").setLevel(logging.CRITICAL)  # keep the summary short
    raise SystemExit(main())
