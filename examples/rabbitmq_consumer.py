"""Consume from RabbitMQ with a delayed retry (TTL queue, no plugin) and a dead-letter
queue.

    python examples/rabbitmq_consumer.py [amqp://guest:guest@localhost:5672/%2F]

The URL defaults to MSGPATTERNS_RABBITMQ_URL (or the local server). RabbitMQ cannot run
in-process: without a reachable server the example says so and exits.

A payment fails twice with a timeout (retried 0.3 s later each time, through the queue
``payments.ledger.retry.300``), then succeeds on attempt 3; a refund for an unknown
payment is rejected and lands in ``payments.ledger.dlq`` with its error record.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from typing import Any

from msgpatterns import Backoff, Consumer, Message, Reject, RetryPolicy

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


def wait_for(condition: Any, timeout: float = 15.0) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > give_up:
            raise SystemExit("timed out waiting for the consumer")
        time.sleep(0.02)


def main() -> int:
    url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get(
        "MSGPATTERNS_RABBITMQ_URL", DEFAULT_URL)
    import pika

    from msgpatterns.brokers import RabbitMQBroker

    try:
        broker = RabbitMQBroker(url, prefetch=10, connect_timeout=3)
    except pika.exceptions.AMQPError as exc:
        print(f"RabbitMQ is not reachable at {url} ({exc!r}); start it (for example "
              "`rabbitmq-server -detached`) or pass its URL. Nothing to do.")
        return 0

    topic = f"payments-{uuid.uuid4().hex[:6]}"
    group = "ledger"
    ledger: list[dict[str, Any]] = []

    def record(message: Message) -> None:
        event = message.body
        if event["type"] == "refund" and event["payment"] not in {e["id"] for e in ledger}:
            raise Reject(f"refund for unknown payment {event['payment']}")
        if event.get("flaky") and message.attempt < 3:
            raise TimeoutError(f"ledger database timed out (attempt {message.attempt})")
        ledger.append(event)
        print(f"recorded {event['type']} {event['id']} on attempt {message.attempt}")

    broker.subscribe(topic, group)  # the exchange, the group's queue and binding
    broker.publish(topic, json.dumps({"type": "payment", "id": "p1", "flaky": True}))
    broker.publish(topic, json.dumps({"type": "refund", "id": "r1", "payment": "p9"}))

    consumer = Consumer(
        broker, record, topics=[topic], group=group, decoder=json.loads,
        max_in_flight=10, poll_timeout=0.05,
        retry=RetryPolicy(max_attempts=5, backoff=Backoff.fixed(0.3)),
    )
    consumer.start()
    try:
        wait_for(lambda: ledger and broker.list_dead_letters(topic, group))
    finally:
        consumer.stop(5)

    for dead in broker.list_dead_letters(topic, group):
        print(f"dead letter {dead.id}: {dead.reason}; error {dead.error_type}, "
              f"{dead.attempts} attempt(s)")
    broker.purge_dead_letters(topic, group)
    broker.close()

    channel = pika.BlockingConnection(pika.URLParameters(url)).channel()
    for queue in (f"{topic}.{group}", f"{topic}.{group}.dlq"):  # tidy up
        channel.queue_delete(queue)
    channel.exchange_delete(topic)
    channel.connection.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
