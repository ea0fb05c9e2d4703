"""Consume a Redis stream with delayed retries, a dead-letter stream and a replay.

    python examples/redis_streams_consumer.py                      # in-process fakeredis
    python examples/redis_streams_consumer.py redis://localhost:6379/0

Three orders arrive on the stream ``orders``: one is fine, one hits a temporarily
unavailable dependency (retried 0.2 s later, attempt 2), one is not JSON (dead-lettered
at once with the reason). We then list the dead-letter stream and replay the record
after "fixing" the handler.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from typing import Any

from msgpatterns import Backoff, Consumer, Message, NeedRetry, RetryPolicy
from msgpatterns.brokers import RedisStreamsBroker


def connect() -> Any:
    if len(sys.argv) > 1:  # a real server
        import redis

        return redis.Redis.from_url(sys.argv[1])
    import fakeredis  # no server given: Redis in this process

    return fakeredis.FakeRedis()


def wait_for(condition: Any, timeout: float = 15.0) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > give_up:
            raise SystemExit("timed out waiting for the consumer")
        time.sleep(0.02)


def main() -> None:
    client = connect()
    broker = RedisStreamsBroker(client, visibility_timeout=60)
    stream = f"orders-{uuid.uuid4().hex[:6]}"  # a fresh stream per run
    billed: list[dict[str, Any]] = []
    lenient = False  # flipped before the replay

    def bill(message: Message) -> None:
        order = message.body  # decoded by `decoder=json.loads`
        if order.get("needs_rates") and message.attempt == 1:
            raise NeedRetry(delay=0.2, reason="exchange rates not loaded yet")
        billed.append(order)
        print(f"billed order {order['id']} (attempt {message.attempt})")

    def decode(raw: bytes) -> Any:
        return json.loads(raw) if not lenient else {"id": raw.decode(), "raw": True}

    broker.publish(stream, json.dumps({"id": 1, "amount": 30}), key="order-1")
    broker.publish(stream, json.dumps({"id": 2, "amount": 12, "needs_rates": True}),
                   key="order-2")
    broker.publish(stream, b"<order id=3/>", key="order-3")  # not JSON

    consumer = Consumer(
        broker, bill, topics=[stream], group="billing", decoder=decode, poll_timeout=0.05,
        retry=RetryPolicy(max_attempts=3, backoff=Backoff.fixed(0.2)),
    )
    consumer.start()
    wait_for(lambda: len(billed) == 2 and broker.list_dead_letters(stream, "billing"))
    consumer.stop(5)

    [dead] = broker.list_dead_letters(stream, "billing")
    print(f"dead letter {dead.id}: {dead.reason} (body {dead.message.raw_body!r})")

    lenient = True  # the fix is deployed: replay the dead letter (attempts reset)
    assert broker.replay_dead_letters(stream, "billing") == 1
    consumer = Consumer(broker, bill, topics=[stream], group="billing", decoder=decode,
                        poll_timeout=0.05)
    consumer.start()
    wait_for(lambda: len(billed) == 3)
    consumer.stop(5)
    assert broker.list_dead_letters(stream, "billing") == []
    print(f"done: {len(billed)} orders billed, dead-letter stream empty")

    broker.close()
    client.delete(stream, f"{stream}:retry:billing", f"{stream}:delayed:billing",
                  f"{stream}:dlq")  # tidy up a real server
    client.close()


if __name__ == "__main__":
    main()
