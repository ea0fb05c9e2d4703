"""Dramatiq actors that run once per order, retry on msgpatterns' schedule and keep
what they give up on where ``msgpatterns dlq`` sees it.

    python examples/dramatiq_actors.py [redis://127.0.0.1:6379/14]

Runs a Dramatiq worker in this process on Redis (MSGPATTERNS_DRAMATIQ_BROKER or the
local server, database 14, a queue of its own). Without a reachable Redis it says so
and exits.

* ``charge("o-1")`` sent twice (two messages, one order): charged once;
* ``charge("o-2")`` times out twice and is redelivered 0.2 s later each time, then
  succeeds on attempt 3;
* ``charge("o-9")`` is rejected: dead-lettered at once, listed by the dead-letter admin
  that ``msgpatterns dlq list`` uses, then replayed and charged once the order exists.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from collections.abc import Callable

DEFAULT_URL = "redis://127.0.0.1:6379/14"


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > give_up:
            raise SystemExit("timed out waiting for the worker")
        time.sleep(0.02)


def main() -> int:
    url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get(
        "MSGPATTERNS_DRAMATIQ_BROKER", DEFAULT_URL)
    import dramatiq
    import redis
    from dramatiq.brokers.redis import RedisBroker

    from msgpatterns import Backoff, MemoryChecker, Reject, RetryPolicy, idempotent
    from msgpatterns.brokers.admin import RedisStreamsDeadLetters
    from msgpatterns.integrations.deadletters import RedisDeadLetterStore
    from msgpatterns.integrations.dramatiq import resend_replayed, use_msgpatterns

    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        print(f"Redis is not reachable at {url} ({exc!r}); start it or pass its URL. "
              "Nothing to do.")
        return 0

    # Dramatiq logs every failed run with its traceback; this example fails on purpose.
    logging.getLogger("dramatiq").setLevel(logging.CRITICAL)
    queue = f"billing-{uuid.uuid4().hex[:6]}"
    broker = RedisBroker(url=url, namespace=f"dramatiq-{queue}")
    store = RedisDeadLetterStore(url)  # records in <queue>:dlq, as msgpatterns dlq reads
    use_msgpatterns(broker, RetryPolicy(max_attempts=5, backoff=Backoff.fixed(0.2),
                                        local_retries=0), dead_letters=store)
    checker = MemoryChecker()  # RedisChecker / SqlChecker across worker processes
    known = {"o-1", "o-2"}
    tries: dict[str, int] = {}
    charged: list[str] = []

    @dramatiq.actor(broker=broker, queue_name=queue, actor_name="billing.charge")
    @idempotent(checker, key=lambda order_id: order_id)
    def charge(order_id: str) -> None:
        tries[order_id] = tries.get(order_id, 0) + 1
        if order_id not in known:
            raise Reject(f"no such order {order_id}")
        if order_id == "o-2" and tries[order_id] < 3:
            raise TimeoutError("bank API timed out")
        print(f"charging {order_id} (attempt {tries[order_id]})")
        charged.append(order_id)

    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=100)
    worker.start()
    admin = RedisStreamsDeadLetters(url)
    try:
        charge.send("o-1")
        charge.send("o-1")
        charge.send("o-2")
        charge.send("o-9")
        wait_for(lambda: len(charged) == 2 and len(admin.list_dead_letters(queue)) == 1)
        for record in admin.list_dead_letters(queue):
            print(f"dead letter {record.message.topic}[{record.id}] "
                  f"group={record.group}: {record.reason}")
        known.add("o-9")  # the order arrived late: replay it
        print(f"replayed {admin.replay_dead_letters(queue)} dead letter(s)")
        print(f"sent back to Dramatiq: {resend_replayed(broker, store, queue)}")
        wait_for(lambda: "o-9" in charged)
    finally:
        worker.stop()
        admin.close()
        client = redis.Redis.from_url(url)
        doomed = client.keys(f"dramatiq-{queue}*") + client.keys(f"{queue}*")
        if doomed:
            client.delete(*doomed)
        client.close()
        store.close()
        broker.close()
    print(f"charged: {charged}; duplicates skipped: {checker.stats.duplicates}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
