"""Your own confluent-kafka poll loop, with msgpatterns' retries and dead letters.

    python examples/raw_kafka_loop.py                  # librdkafka's in-process mock cluster
    python examples/raw_kafka_loop.py kafka1:9092      # a real cluster

No Consumer here: the loop is plain ``consumer.poll()``. ``KafkaLoop`` turns records into
Messages and carries out what ``run_handler`` decides, with the KafkaBroker's own
topics: reading 2 asks for a retry in 0.3 s (produced to ``<topic>.retry``, due then,
attempt 2, never early), reading 3 is rejected and produced to ``<topic>.DLT`` with its
origin and full record. Only the contiguous settled prefix is committed.
``msgpatterns dlq list`` shows the dead letter; ``msgpatterns dlq replay`` sends it back.
"""

from __future__ import annotations

import sys
import time
import uuid
from typing import Any

from confluent_kafka import Consumer, Producer

from msgpatterns import Backoff, Message, NeedRetry, Reject, RetryPolicy
from msgpatterns.cli import main as msgpatterns_cli
from msgpatterns.raw.kafka import KafkaLoop
from msgpatterns.settlement import DeadLetterIt, RetryLater


def main() -> None:
    cluster = None
    if len(sys.argv) > 1:
        bootstrap = sys.argv[1]
    else:
        from msgpatterns.testing.kafka_mock import KafkaMockCluster

        cluster = KafkaMockCluster()
        bootstrap = cluster.bootstrap_servers
        print(f"mock Kafka cluster at {bootstrap}")
    topic, group = f"readings-{uuid.uuid4().hex[:6]}", "storage"
    policy = RetryPolicy(max_attempts=5, backoff=Backoff.fixed(1.0), local_retries=0)
    producer = Producer({"bootstrap.servers": bootstrap})
    consumer = Consumer({
        "bootstrap.servers": bootstrap, "group.id": group,
        "enable.auto.commit": False,  # KafkaLoop commits the settled prefix
        "auto.offset.reset": "earliest",
        "allow.auto.create.topics": True,  # the mock cluster creates topics on demand
        "group.protocol": "consumer", "fetch.wait.max.ms": 50,
    })
    asked_at: dict[str, float] = {}
    stored: list[str] = []
    dead: list[str] = []  # confirmed by the cluster once apply() returns
    lenient = False  # flipped before the replay

    def store(message: Message) -> None:
        reading = message.raw_body.decode()
        if reading == "reading-2" and message.attempt == 1:
            asked_at[reading] = time.monotonic()
            raise NeedRetry(delay=0.3, reason="time-series database busy")
        if reading == "reading-3" and not lenient:
            raise Reject("sensor unknown")
        late = time.monotonic() - asked_at.get(reading, time.monotonic())
        print(f"stored {reading} (attempt {message.attempt}"
              + (f", {late:.2f}s after its retry was asked" if reading in asked_at else "")
              + ")")
        stored.append(reading)

    for n in (1, 2, 3):  # any producer will do
        producer.produce(topic, value=f"reading-{n}".encode(), key=b"sensor")
    producer.flush(10)

    loop = KafkaLoop(consumer, group=group, topics=[topic], producer=producer)

    def run_until(condition: Any, limit: float = 15.0) -> None:
        give_up = time.monotonic() + limit
        while not condition():
            if time.monotonic() > give_up:
                raise SystemExit("timed out")
            wait = loop.maintain()  # resume due retries, commit the settled prefix
            record = consumer.poll(min(0.2, 0.2 if wait is None else wait))
            message = None if record is None else loop.message(record)
            if message is None:
                continue
            decision = loop.handle(message, store, policy=policy)
            if isinstance(decision, RetryLater):
                print(f"{message.raw_body.decode()}: retry in {decision.delay:g}s as "
                      f"attempt {decision.attempt}")
            elif isinstance(decision, DeadLetterIt):
                print(f"{message.raw_body.decode()}: dead-lettered ({decision.reason})")
                dead.append(message.raw_body.decode())

    try:
        run_until(lambda: {"reading-1", "reading-2"} <= set(stored) and dead)
        url = f"kafka://{bootstrap}"
        options = [url, "--topic", topic, "--group", group]
        assert msgpatterns_cli(["dlq", "list", *options]) == 0
        lenient = True  # "fixed" the sensor table; replay the dead letter
        assert msgpatterns_cli(["dlq", "replay", *options, "--all"]) == 0
        run_until(lambda: "reading-3" in stored)
        print("committed:", sorted(loop.commit().items()))
    finally:
        loop.close()
        consumer.close()
        if cluster is not None:
            cluster.close()


if __name__ == "__main__":
    main()
