"""A Celery app whose tasks dead-letter to Redis, for a real ``celery worker`` process
(``celery -A celery_worker_app worker``). Configured by environment variables so the
test process and the worker build the same app: MP_CELERY_BROKER (broker URL),
MP_CELERY_PREFIX (task names and queue), MP_CELERY_STATE (the Redis URL of the dead
letters and of the tasks' effects)."""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from msgpatterns import Backoff, RedisChecker, RetryPolicy
from msgpatterns.integrations.celery import idempotent_task
from msgpatterns.integrations.deadletters import RedisDeadLetterStore

POLICY = RetryPolicy(max_attempts=2, backoff=Backoff.fixed(0.2), local_retries=0)


def make_app(broker: str, prefix: str, state: str) -> tuple[Celery, Any, Any]:
    """The app and its ``ship`` task: fails until ``<prefix>:fixed`` is set, counts its
    runs per order in ``<prefix>:shipped``; an order ``slow-*`` waits while
    ``<prefix>:hold`` exists."""
    app = Celery(prefix, broker=broker)
    app.conf.update(task_default_queue=prefix, worker_hijack_root_logger=False,
                    broker_connection_retry_on_startup=True,
                    # kombu restores an unacked task of a dead worker at its first scan
                    # after visibility_timeout: scan every second (default: ~100 s).
                    # Own unacked keys: a restore never touches other apps' tasks.
                    broker_transport_options={"visibility_timeout": 4,
                                              "unacked_restore_interval": 1,
                                              "unacked_restore_throttle": 1,
                                              "unacked_key": f"{prefix}:unacked",
                                              "unacked_index_key": f"{prefix}:unacked_index",
                                              "unacked_mutex_key": f"{prefix}:unacked_mutex"})
    client = redis.Redis.from_url(state)
    store = RedisDeadLetterStore(client)
    checker = RedisChecker(state, namespace=prefix, lease=2)

    @idempotent_task(app, checker, key=lambda order_id: order_id, policy=POLICY,
                     dead_letters=store, name=f"{prefix}.ship", group="shipping")
    def ship(order_id: str) -> None:
        if not client.exists(f"{prefix}:fixed"):
            raise ConnectionError(f"carrier API down for {order_id}")
        if order_id.startswith("slow"):
            client.set(f"{prefix}:started:{order_id}", os.getpid())
            while client.exists(f"{prefix}:hold"):
                time.sleep(0.02)
        client.hincrby(f"{prefix}:shipped", order_id, 1)

    return app, ship, store


app, ship, store = make_app(os.environ.get("MP_CELERY_BROKER", "redis://127.0.0.1:6379/14"),
                            os.environ.get("MP_CELERY_PREFIX", "mp-celery"),
                            os.environ.get("MP_CELERY_STATE", "redis://127.0.0.1:6379/14"))
