"""FastStream on Kafka, NATS JetStream and Redis lists, with msgpatterns' retries,
dead letters and idempotency, against real brokers.

    python examples/faststream_kafka_nats_lists.py

* Kafka runs on librdkafka's in-process mock cluster (no server needed), through
  FastStream's aiokafka broker: ``payments`` fails twice and succeeds on attempt 3;
  ``refunds`` rejects an unknown payment into ``refunds.DLT``, which the ``KafkaBroker``
  dead-letter admin (what ``msgpatterns dlq`` uses) lists.
* NATS JetStream (``MSGPATTERNS_NATS_URL`` or nats://127.0.0.1:4222) and a Redis list
  (``MSGPATTERNS_REDIS_URL`` or redis://127.0.0.1:6379/14) run the same handlers when
  their server is reachable, and are skipped with a line saying so when it is not.

The app checks its subscribers when it starts (``middleware.check(broker)``): a
subscriber the middleware cannot serve is refused there, not at its first message.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

from msgpatterns import Backoff, MemoryChecker, Reject, RetryPolicy, idempotent
from msgpatterns.integrations.faststream import Delivery, MsgpatternsMiddleware

policy = RetryPolicy(max_attempts=5, backoff=Backoff.fixed(0.2), local_retries=0)


async def until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > give_up:
            raise SystemExit("timed out")
        await asyncio.sleep(0.02)


class Handlers:
    """A flaky payment handler (idempotent) and a rejecting refund handler."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.charged: list[str] = []
        self.refused = 0
        self.checker = MemoryChecker()

    def payments(self) -> Callable[..., Any]:
        @idempotent(self.checker)  # key: delivery.key or delivery.id
        async def charge(body: dict[str, Any], delivery: Delivery) -> None:
            if delivery.attempt < 3:
                print(f"[{self.where}] {body['payment']}: attempt {delivery.attempt} "
                      "timed out")
                raise TimeoutError("bank API timed out")
            self.charged.append(body["payment"])
            print(f"[{self.where}] charged {body['payment']} on attempt {delivery.attempt}")
        return charge

    def refunds(self) -> Callable[..., Any]:
        async def refund(body: dict[str, Any]) -> None:
            self.refused += 1
            raise Reject(f"no payment {body['payment']}")
        return refund


async def kafka() -> None:
    from faststream import AckPolicy
    from faststream.kafka import KafkaBroker

    from msgpatterns.brokers import KafkaBroker as Adapter
    from msgpatterns.testing.kafka_mock import KafkaMockCluster

    cluster = KafkaMockCluster()
    tag = uuid.uuid4().hex[:6]
    middleware = MsgpatternsMiddleware(policy)
    broker = KafkaBroker(cluster.bootstrap_servers, middlewares=[middleware], logger=None)
    handlers = Handlers("kafka")
    # Commit after the handler (at least once); one group per subscriber, so that the
    # second does not make the first rebalance (see docs/testing.md, session.timeout.ms).
    options = {"auto_offset_reset": "earliest", "ack_policy": AckPolicy.ACK}
    broker.subscriber(f"payments-{tag}", group_id="payments", **options)(handlers.payments())
    broker.subscriber(f"refunds-{tag}", group_id="refunds", **options)(handlers.refunds())
    middleware.check(broker)
    async with broker:
        await broker.start()
        await broker.publish({"payment": "p-1"}, topic=f"payments-{tag}", key=b"p-1")
        await broker.publish({"payment": "p-9"}, topic=f"refunds-{tag}", key=b"p-9")
        await until(lambda: handlers.charged == ["p-1"] and handlers.refused == 1)
    adapter = Adapter(cluster.bootstrap_servers)
    try:
        await until(lambda: bool(adapter.dead_letter_admin().list_dead_letters(
            f"refunds-{tag}")))
        for record in adapter.dead_letter_admin().list_dead_letters(f"refunds-{tag}"):
            print(f"[kafka] dead letter in refunds-{tag}.DLT: key={record.message.key} "
                  f"{record.reason}")
    finally:
        adapter.close()
        cluster.close()


async def nats() -> None:
    import nats as nats_py
    from faststream.nats import JStream, NatsBroker, PullSub

    from msgpatterns.brokers import NatsJetStreamBroker

    url = os.environ.get("MSGPATTERNS_NATS_URL", "nats://127.0.0.1:4222")
    try:
        probe = await nats_py.connect(url, connect_timeout=2, max_reconnect_attempts=0,
                                      allow_reconnect=False)
        await probe.close()
    except Exception as exc:
        print(f"[nats] not reachable at {url} ({type(exc).__name__}); skipped")
        return
    subject = f"payments_{uuid.uuid4().hex[:6]}"
    stream = JStream(NatsJetStreamBroker.stream_name(subject),
                     subjects=[subject, NatsJetStreamBroker.dead_letter_subject(subject)])
    middleware = MsgpatternsMiddleware(policy)
    broker = NatsBroker(url, middlewares=[middleware], logger=None)
    handlers = Handlers("nats")
    broker.subscriber(subject, stream=stream, durable="billing",
                      pull_sub=PullSub(batch_size=1, timeout=0.2))(handlers.payments())
    middleware.check(broker)
    try:
        async with broker:
            await broker.start()
            await broker.publish({"payment": "p-2"}, subject=subject, stream=stream.name,
                                 headers={"message_id": "p-2"})
            await until(lambda: handlers.charged == ["p-2"])
    finally:
        nc = await nats_py.connect(url)
        await nc.jetstream().delete_stream(stream.name)
        await nc.close()


async def redis_list() -> None:
    import redis.asyncio as aioredis
    from faststream.redis import RedisBroker

    url = os.environ.get("MSGPATTERNS_REDIS_URL", "redis://127.0.0.1:6379/14")
    client = aioredis.Redis.from_url(url, socket_connect_timeout=2)
    try:
        await client.ping()
    except Exception as exc:
        print(f"[redis] not reachable at {url} ({type(exc).__name__}); skipped")
        await client.aclose()
        return
    name = f"payments-{uuid.uuid4().hex[:6]}"
    middleware = MsgpatternsMiddleware(policy)
    broker = RedisBroker(url, middlewares=[middleware], logger=None)
    handlers = Handlers("redis list")
    broker.subscriber(list=name)(handlers.payments())
    middleware.check(broker)
    try:
        async with broker:
            await broker.start()
            await broker.publish({"payment": "p-3"}, list=name,
                                 headers={"message_id": "p-3"})
            await until(lambda: handlers.charged == ["p-3"])
    finally:
        await client.delete(name, f"{name}:fs-delayed-list", f"{name}:fs-delayed-list:data")
        await client.aclose()


async def main() -> None:
    await kafka()
    await nats()
    await redis_list()


if __name__ == "__main__":
    import logging

    logging.getLogger("aiokafka").setLevel(logging.ERROR)
    asyncio.run(main())
