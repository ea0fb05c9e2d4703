"""An asyncio consumer: ``async def`` handlers, many in flight, the same guarantees.

Orders arrive on an at-least-once broker (the in-memory one here, with duplicate
deliveries and lost acks). The handler awaits a slow "payment service" (50 ms), so a
thread per message would be the bottleneck; ``AsyncConsumer`` keeps 200 handlers in
flight on one event loop. Failures go through the same retry policy as the sync
``Consumer``: a flaky call is redelivered with its attempt count, a poison order ends
in a dead letter with the full record.

    python examples/async_consumer.py

With Redis, the same consumer runs on ``AsyncRedisStreamsBroker("redis://...")``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter

from msgpatterns import Backoff, Message, Reject, RetryPolicy
from msgpatterns.aio import AsyncConsumer, AsyncInMemoryBroker

ORDERS = 1000


async def main() -> None:
    broker = AsyncInMemoryBroker(seed=7, duplicate_rate=0.1, lost_ack_rate=0.05)
    for i in range(ORDERS):
        amount = -1 if i == 13 else 10 + i % 90  # order 13 is poison
        await broker.publish("orders", json.dumps({"order": i, "amount": amount}).encode(),
                             key=f"order-{i}")
    calls: Counter[int] = Counter()

    async def charge(message: Message) -> None:
        order = message.body
        await asyncio.sleep(0.05)  # the payment service
        if order["amount"] < 0:
            raise Reject(f"negative amount {order['amount']}")
        if order["order"] % 100 == 7 and message.attempt == 1:
            raise ConnectionError("payment service timed out")  # redelivered
        calls[order["order"]] += 1

    consumer = AsyncConsumer(
        broker, charge, topics=["orders"], group="payments", max_in_flight=200,
        decoder=json.loads,
        retry=RetryPolicy(max_attempts=5, backoff=Backoff.exponential(initial=1.0)),
    )
    started = time.perf_counter()
    stats = await consumer.run_until_idle(timeout=60)  # retries wait on virtual time
    elapsed = time.perf_counter() - started

    [poison] = broker.dead_letters
    print(f"{ORDERS} orders, 50 ms each, 200 in flight: {elapsed:.2f}s "
          f"(one thread per call in turn would take {ORDERS * 0.05:.0f}s)")
    print(f"charged {len(calls)} orders; redelivered {stats.redelivered}; "
          f"{sum(calls.values()) - len(calls)} runs were at-least-once duplicates "
          f"(examples/async_idempotent.py makes each effect happen once)")
    print(f"dead letter: {poison.message.key} after {poison.attempts} attempt(s): "
          f"{poison.reason}")
    assert len(calls) == ORDERS - 1 and broker.pending == 0
    assert poison.message.key == "order-13"


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR, format="%(levelname)s %(message)s")
    asyncio.run(main())
