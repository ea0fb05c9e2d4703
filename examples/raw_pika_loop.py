"""Your own pika ``basic_consume`` callback, with msgpatterns' retries and dead letters.

    python examples/raw_pika_loop.py                 # amqp://guest:guest@127.0.0.1:5672/%2F
    python examples/raw_pika_loop.py amqp://user:pass@host:5672/vhost

No Consumer here: the callback is plain pika. ``PikaLoop`` turns deliveries into
Messages and carries out what ``run_handler`` decides, with the RabbitMQBroker's own
topology: order 2 asks for a retry in 0.3 s (``NeedRetry(delay=0.3)``; it waits in the
TTL queue ``T.G.retry.300`` and comes back with attempt 2, never early), order 3 is
rejected and lands in ``T.G.dlq`` with its full record. ``msgpatterns dlq list`` shows
it and ``msgpatterns dlq replay`` sends it back (attempt 1 again).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import Any

import pika

from msgpatterns import Backoff, Message, NeedRetry, Reject, RetryPolicy
from msgpatterns.cli import main as msgpatterns_cli
from msgpatterns.raw.pika import PikaLoop

URL = sys.argv[1] if len(sys.argv) > 1 else os.environ.get(
    "MSGPATTERNS_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672/%2F")


def main() -> None:
    connection = pika.BlockingConnection(pika.URLParameters(URL))
    channel = connection.channel()
    topic, group = f"orders-{uuid.uuid4().hex[:6]}", "billing"
    policy = RetryPolicy(max_attempts=5, backoff=Backoff.fixed(1.0), local_retries=0)
    asked_at: dict[str, float] = {}
    done: list[str] = []
    rejected: list[str] = []
    lenient = False  # flipped before the replay

    def charge(message: Message) -> None:
        order = message.raw_body.decode()
        if order == "order-2" and message.attempt == 1:
            asked_at[order] = time.monotonic()
            raise NeedRetry(delay=0.3, reason="payment provider busy")
        if order == "order-3" and not lenient:
            rejected.append(order)  # dead-lettered (confirmed) before the callback returns
            raise Reject("unknown customer")
        late = time.monotonic() - asked_at.get(order, time.monotonic())
        print(f"charged {order} (attempt {message.attempt}"
              + (f", {late:.2f}s after its retry was asked" if order in asked_at else "")
              + ")")
        done.append(order)

    loop = PikaLoop(channel, topic=topic, group=group)
    queue = loop.declare()
    try:
        channel.basic_qos(prefetch_count=10)
        channel.basic_consume(queue, loop.callback(charge, policy=policy))
        for n in (1, 2, 3):  # any publisher will do
            channel.basic_publish(topic, topic, f"order-{n}".encode(),
                                  pika.BasicProperties(message_id=f"order-{n}"))

        def run_until(condition: Any, limit: float = 10.0) -> None:
            give_up = time.monotonic() + limit
            while not condition():
                if time.monotonic() > give_up:
                    raise SystemExit("timed out")
                connection.process_data_events(time_limit=0.05)

        run_until(lambda: {"order-1", "order-2"} <= set(done) and rejected)

        options = [URL, "--topic", topic, "--group", group]
        assert msgpatterns_cli(["dlq", "list", *options]) == 0
        lenient = True  # "fixed" the customer table; replay the dead letter
        assert msgpatterns_cli(["dlq", "replay", *options, "--all"]) == 0
        run_until(lambda: "order-3" in done)
        assert done == ["order-1", "order-2", "order-3"], done
    finally:
        loop.close()
        cleanup = connection.channel()
        for name in (queue, f"{queue}.dlq", f"{queue}.retry.300"):
            cleanup.queue_delete(name)
        cleanup.exchange_delete(topic)
        connection.close()


if __name__ == "__main__":
    main()
