"""Your own redis-py XREADGROUP loop, with msgpatterns' retries and dead letters.

    python examples/raw_redis_loop.py                       # redis://127.0.0.1:6379/15
    python examples/raw_redis_loop.py redis://host:6379/0

No Consumer here: the loop is plain redis-py. ``RedisLoop`` turns entries into Messages
and carries out what ``run_handler`` decides, with the RedisStreamsBroker's own keys:
order 2 asks for a retry in 0.3 s (``NeedRetry(delay=0.3)``; it comes back through
``S:delayed:G`` -> ``S:retry:G`` with attempt 2, never early), order 3 is rejected and
lands in ``S:dlq`` with its full record. ``msgpatterns dlq list`` shows it and
``msgpatterns dlq replay`` sends it back (attempt 1 again).
"""

from __future__ import annotations

import os
import sys
import time
import uuid

import redis

from msgpatterns import Backoff, Message, NeedRetry, Reject, RetryPolicy
from msgpatterns.cli import main as msgpatterns_cli
from msgpatterns.raw.redis import RedisLoop
from msgpatterns.settlement import DeadLetterIt, RetryLater

URL = sys.argv[1] if len(sys.argv) > 1 else os.environ.get(
    "MSGPATTERNS_REDIS_URL", "redis://127.0.0.1:6379/15")


def main() -> None:
    client = redis.Redis.from_url(URL)
    stream = f"orders-{uuid.uuid4().hex[:6]}"  # a fresh stream per run
    group, consumer = "billing", "billing-1"
    policy = RetryPolicy(max_attempts=5, backoff=Backoff.fixed(1.0), local_retries=0)
    asked_at: dict[str, float] = {}
    done: list[str] = []
    lenient = False  # flipped before the replay

    def charge(message: Message) -> None:
        order = message.raw_body.decode()
        if order == "order-2" and message.attempt == 1:
            asked_at[order] = time.monotonic()
            raise NeedRetry(delay=0.3, reason="payment provider busy")
        if order == "order-3" and not lenient:
            raise Reject("unknown customer")
        late = time.monotonic() - asked_at.get(order, time.monotonic())
        print(f"charged {order} (attempt {message.attempt}"
              + (f", {late:.2f}s after its retry was asked" if order in asked_at else "")
              + ")")
        done.append(order)

    loop = RedisLoop(client, group=group, consumer=consumer, visibility_timeout=60)
    try:
        loop.subscribe(stream)
        for n in (1, 2, 3):
            client.xadd(stream, {"body": f"order-{n}"})  # any producer will do

        def run_until(condition: object, limit: float = 10.0) -> None:
            give_up = time.monotonic() + limit
            for message in loop.recover(stream):  # a restart re-reads its pending list
                loop.handle(message, charge, policy=policy)
            while not condition():  # type: ignore[operator]
                if time.monotonic() > give_up:
                    raise SystemExit("timed out")
                wait = loop.promote(stream)  # due retries -> the retry stream
                reply = client.xreadgroup(group, consumer, loop.streams(stream), count=10,
                                          block=loop.block_ms(wait, 0.2))
                for message in loop.messages(reply):
                    decision = loop.handle(message, charge, policy=policy)
                    if isinstance(decision, RetryLater):
                        print(f"{message.raw_body.decode()}: retry in "
                              f"{decision.delay:g}s as attempt {decision.attempt}")
                    elif isinstance(decision, DeadLetterIt):
                        print(f"{message.raw_body.decode()}: dead-lettered "
                              f"({decision.reason})")

        run_until(lambda: {"order-1", "order-2"} <= set(done)
                  and client.xlen(f"{stream}:dlq") == 1)

        dlq = ["dlq", "--topic", stream, "--group", group]
        assert msgpatterns_cli([dlq[0], "list", URL, *dlq[1:]]) == 0
        lenient = True  # "fixed" the customer table; replay the dead letter
        assert msgpatterns_cli([dlq[0], "replay", URL, *dlq[1:], "--all"]) == 0
        run_until(lambda: "order-3" in done)
        assert done == ["order-1", "order-2", "order-3"], done
    finally:
        loop.close()
        client.delete(stream, f"{stream}:retry:{group}", f"{stream}:delayed:{group}",
                      f"{stream}:dlq")
        client.close()


if __name__ == "__main__":
    main()
