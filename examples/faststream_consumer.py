"""FastStream handlers with msgpatterns' retries, dead letters and idempotency.

    python examples/faststream_consumer.py

Runs on FastStream's in-memory TestRabbitBroker (no server needed); swap in
``RabbitBroker("amqp://...")`` to run it against RabbitMQ unchanged.

* ``payments`` (sync, ``@idempotent``): the same payment published twice is charged once;
* ``ledger`` fails with a timeout: its copy is parked in the TTL queue
  ``ledger.retry.250`` with ``x-msgpatterns-attempt: 2`` (RabbitMQ moves it back to
  ``ledger`` after 250 ms);
* ``refunds`` rejects an unknown payment: it lands in ``refunds.dlq`` with its record.
"""

from __future__ import annotations

import asyncio
from typing import Any

from faststream.rabbit import RabbitBroker, RabbitMessage, RabbitRouter, TestRabbitBroker

from msgpatterns import Backoff, MemoryChecker, Reject, RetryPolicy, idempotent
from msgpatterns import headers as h
from msgpatterns.integrations.faststream import Delivery, MsgpatternsMiddleware

policy = RetryPolicy(max_attempts=5, backoff=Backoff.levels([0.25, 1, 5]), local_retries=0)
checker = MemoryChecker()

broker = RabbitBroker()
router = RabbitRouter(middlewares=[MsgpatternsMiddleware(policy)])
charged: list[str] = []


@router.subscriber("payments")
@idempotent(checker)  # key: delivery.key or delivery.id (the AMQP message_id)
def charge(body: dict[str, Any], delivery: Delivery) -> None:
    charged.append(body["payment"])
    print(f"charged {body['payment']} (message {delivery.id}, attempt {delivery.attempt})")


@router.subscriber("ledger")
async def post_to_ledger(body: dict[str, Any], delivery: Delivery) -> None:
    print(f"ledger attempt {delivery.attempt} for {body['payment']}: timing out")
    raise TimeoutError("ledger busy")


@router.subscriber("refunds")
async def refund(body: dict[str, Any]) -> None:
    raise Reject(f"unknown payment {body['payment']}")


# What RabbitMQ would hold: readers of the retry and dead-letter queues, for the demo.
@broker.subscriber("ledger.retry.250")
async def parked(body: Any, msg: RabbitMessage) -> None:
    print(f"parked for 250 ms: attempt {msg.headers[h.ATTEMPT]}, "
          f"last error {msg.headers[h.ERROR_TYPE]}")


@broker.subscriber("refunds.dlq")
async def dead(body: Any, msg: RabbitMessage) -> None:
    print(f"dead letter {msg.message_id}: {msg.headers[h.DEAD_LETTER_REASON]} after "
          f"{msg.headers[h.ATTEMPT]} attempt(s); body {msg.body!r}")


async def main() -> None:
    broker.include_router(router)
    async with TestRabbitBroker(broker) as test:
        await test.publish({"payment": "p-1"}, queue="payments", message_id="p-1")
        await test.publish({"payment": "p-1"}, queue="payments", message_id="p-1")
        await test.publish({"payment": "p-2"}, queue="ledger", message_id="p-2")
        await test.publish({"payment": "p-3"}, queue="refunds", message_id="r-3")
    assert charged == ["p-1"], charged
    print(f"duplicates skipped: {checker.stats.duplicates}")


if __name__ == "__main__":
    asyncio.run(main())
