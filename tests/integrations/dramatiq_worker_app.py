"""Dramatiq actors under MsgpatternsMiddleware, for a real ``dramatiq`` worker process
(``python -m dramatiq dramatiq_worker_app``). Configured by environment variables so
the test and the worker build the same broker: MP_DRAMATIQ_BROKER (``redis://`` or
``amqp://``), MP_DRAMATIQ_PREFIX (queue and key names), MP_DRAMATIQ_STATE (the Redis
URL of the checker, the dead letters and the actors' effects)."""

from __future__ import annotations

import os
import time
from typing import Any

import dramatiq
import redis

from msgpatterns import Backoff, RedisChecker, Reject, RetryPolicy, idempotent
from msgpatterns.integrations.deadletters import RedisDeadLetterStore
from msgpatterns.integrations.dramatiq import use_msgpatterns

POLICY = RetryPolicy(max_attempts=3, backoff=Backoff.fixed(0.2), local_retries=0)


def make_broker(url: str) -> Any:
    if url.startswith("amqp"):
        from dramatiq.brokers.rabbitmq import RabbitmqBroker

        return RabbitmqBroker(url=url)
    from dramatiq.brokers.redis import RedisBroker

    # A worker that died is noticed after 2 s, by maintenance on every command.
    return RedisBroker(url=url, namespace=f"dramatiq-{PREFIX}", heartbeat_timeout=2000,
                       maintenance_chance=1_000_000)


PREFIX = os.environ.get("MP_DRAMATIQ_PREFIX", "mp-dramatiq")
STATE = os.environ.get("MP_DRAMATIQ_STATE", "redis://127.0.0.1:6379/14")
broker = make_broker(os.environ.get("MP_DRAMATIQ_BROKER", STATE))
state = redis.Redis.from_url(STATE)
store = RedisDeadLetterStore(state)
use_msgpatterns(broker, POLICY, dead_letters=store)
dramatiq.set_broker(broker)
# A lease shorter than the test's patience: a killed worker's claim expires in 2 s.
checker = RedisChecker(STATE, namespace=PREFIX, lease=2)


@dramatiq.actor(queue_name=PREFIX, actor_name=f"{PREFIX}.ship")
@idempotent(checker, key=lambda order_id: order_id)
def ship(order_id: str) -> None:
    tries = state.incr(f"{PREFIX}:tries:{order_id}")
    if order_id.startswith("flaky") and tries < 3:
        raise ConnectionError(f"carrier API down ({tries})")
    if order_id.startswith("bad"):
        raise Reject(f"unknown order {order_id}")
    if order_id.startswith("broken") and not state.exists(f"{PREFIX}:fixed"):
        raise ValueError("always")
    if order_id.startswith("slow"):
        state.set(f"{PREFIX}:started:{order_id}", os.getpid())
        while state.exists(f"{PREFIX}:hold"):
            time.sleep(0.02)
    state.hincrby(f"{PREFIX}:shipped", order_id, 1)
