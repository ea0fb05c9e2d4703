"""Celery ``acks_late`` tasks that run once per order, retry on msgpatterns' schedule and
record what they give up on.

    python examples/celery_tasks.py [redis://127.0.0.1:6379/14]

Starts a worker in a thread on Redis (MSGPATTERNS_CELERY_BROKER or the local server,
database 14, a queue of its own). Without a reachable Redis it says so and exits.

* ``charge("o-1")`` sent twice (two task ids, one order): charged once;
* ``settle_invoice`` times out twice, retried by Celery 0.3 s later each time
  (``self.retry(countdown=...)`` from the policy), then succeeds on attempt 3;
* ``refund("o-9")`` is rejected: the task fails at once and its record is kept in
  Redis (``RedisDeadLetterStore``), where ``msgpatterns dlq list --topic
  billing.refund.<queue> redis://...`` lists it; replayed (as ``msgpatterns dlq
  replay`` does) and sent back to Celery with ``resend_replayed``, it runs again once
  the payment exists.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
import uuid
from collections.abc import Callable

from msgpatterns import Backoff, MemoryChecker, Reject, RetryPolicy

DEFAULT_URL = "redis://127.0.0.1:6379/14"


def wait_for(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > give_up:
            raise SystemExit("timed out waiting for the worker")
        time.sleep(0.02)


def main() -> int:
    url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get(
        "MSGPATTERNS_CELERY_BROKER", DEFAULT_URL)
    import redis
    from celery import Celery
    from celery.contrib.testing.worker import start_worker

    from msgpatterns.brokers.admin import RedisStreamsDeadLetters
    from msgpatterns.integrations.celery import idempotent_task, resend_replayed
    from msgpatterns.integrations.deadletters import RedisDeadLetterStore

    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        print(f"Redis is not reachable at {url} ({exc!r}); start it or pass its URL. "
              "Nothing to do.")
        return 0

    queue = f"billing-{uuid.uuid4().hex[:6]}"
    app = Celery("billing", broker=url)
    app.conf.update(task_default_queue=queue, worker_hijack_root_logger=False,
                    broker_connection_retry_on_startup=True)
    checker = MemoryChecker()  # RedisChecker / SqlChecker across processes
    store = RedisDeadLetterStore(url)  # records in <task name>:dlq: msgpatterns dlq reads
    paid = {"o-1"}
    refunded: list[str] = []
    policy = RetryPolicy(max_attempts=5, backoff=Backoff.fixed(0.3), local_retries=0)
    done: list[str] = []
    tries: list[int] = []

    @idempotent_task(app, checker, key=lambda order_id: order_id, policy=policy,
                     dead_letters=store, name="billing.charge")
    def charge(order_id: str) -> None:
        print(f"charging {order_id}")
        done.append(order_id)

    @idempotent_task(app, policy=policy, dead_letters=store, name="billing.settle_invoice")
    def settle_invoice(invoice: str) -> str:
        tries.append(time.monotonic())
        print(f"settling {invoice}: attempt {len(tries)}")
        if len(tries) < 3:
            raise TimeoutError("bank API timed out")
        return "settled"

    @idempotent_task(app, policy=policy, dead_letters=store,
                     name=f"billing.refund.{queue}", group="billing")
    def refund(order_id: str) -> None:
        if order_id not in paid:
            raise Reject(f"no payment for {order_id}")
        refunded.append(order_id)
        print(f"refunded {order_id}")

    admin = RedisStreamsDeadLetters(url)
    topic = refund.name
    try:
        with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
            charge.delay("o-1")
            charge.delay("o-1")
            settle_invoice.delay("inv-7")
            refund.delay("o-9")
            wait_for(lambda: checker.stats.duplicates == 1 and len(tries) == 3
                     and len(admin.list_dead_letters(topic)) == 1)
            for record in admin.list_dead_letters(topic):
                print(f"dead letter {record.message.topic}[{record.message.id}]: "
                      f"{record.reason}")
            paid.add("o-9")  # the payment showed up late: replay the refund
            print(f"replayed {admin.replay_dead_letters(topic)} dead letter(s)")
            print(f"sent back to Celery: {resend_replayed(refund, store)}")
            wait_for(lambda: refunded == ["o-9"])
    finally:
        admin.close()
        store.close()
        client = redis.Redis.from_url(url)
        client.delete(queue, f"_kombu.binding.{queue}", *client.keys(f"{topic}*"))
        client.close()

    gaps = ", ".join(f"{b - a:.2f}s" for a, b in itertools.pairwise(tries))
    print(f"charged: {done}; duplicates skipped: {checker.stats.duplicates}")
    print(f"invoice retried after {gaps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
