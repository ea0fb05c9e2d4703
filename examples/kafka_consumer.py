"""Consume a Kafka topic with retries on ``<topic>.retry``, dead letters on
``<topic>.DLT`` and commits that never skip an unfinished message.

    python examples/kafka_consumer.py                  # librdkafka's in-process mock cluster
    python examples/kafka_consumer.py kafka1:9092      # a real cluster

Four sensor readings arrive. Reading 2 is processed slowly (explicit ack from another
thread, after readings 3 and 4 are done): the committed offset waits for it. Reading 3
fails once and is retried through ``readings.retry`` half a second later. Reading 4 is
garbage and goes to ``readings.DLT`` with its origin and error in the headers.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from typing import Any

from msgpatterns import Backoff, Consumer, Message, RetryPolicy
from msgpatterns.brokers import KafkaBroker


def wait_for(condition: Any, timeout: float = 30.0) -> None:
    give_up = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > give_up:
            raise SystemExit("timed out waiting for the consumer")
        time.sleep(0.02)


def main() -> None:
    cluster = None
    if len(sys.argv) > 1:
        bootstrap = sys.argv[1]
    else:
        from msgpatterns.testing.kafka_mock import KafkaMockCluster

        cluster = KafkaMockCluster()
        bootstrap = cluster.bootstrap_servers
        print(f"mock Kafka cluster at {bootstrap}")
    # The mock cluster creates topics on demand; on a real cluster create
    # `readings`, `readings.retry` and `readings.DLT` up front.
    broker = KafkaBroker(bootstrap, consumer_config={"allow.auto.create.topics": True})
    topic = f"readings-{uuid.uuid4().hex[:6]}"
    stored: list[int] = []
    slow: list[Message] = []

    def store(message: Message) -> None:
        reading = message.body
        if reading["sensor"] == 2:  # finished later, by another thread
            message.disable_auto_ack()
            slow.append(message)
            return
        if reading["sensor"] == 3 and message.attempt == 1:
            raise ConnectionError("time-series database unavailable")
        stored.append(reading["sensor"])
        print(f"stored sensor {reading['sensor']} (attempt {message.attempt}, "
              f"partition {message.partition}, offset {message.offset})")

    for sensor in (1, 2, 3):  # one key: one partition, in order
        broker.publish(topic, json.dumps({"sensor": sensor, "value": 20 + sensor}), key="hall")
    broker.publish(topic, b"\x00\x01 garbage", key="hall")

    consumer = Consumer(
        broker, store, topics=[topic], group="archiver", decoder=json.loads,
        poll_timeout=0.05, retry=RetryPolicy(max_attempts=3, backoff=Backoff.fixed(0.5)),
    )
    consumer.start()
    wait_for(lambda: sorted(stored) == [1, 3] and broker.list_dead_letters(topic))
    partition, offset = slow[0].partition or 0, slow[0].offset
    position = broker.commit()[("archiver", topic, partition)]
    print(f"committed offset of partition {partition} while sensor 2 (offset {offset}) "
          f"is unfinished: {position}")
    assert position == offset  # never past an unfinished message
    threading.Thread(target=slow[0].ack).start()  # sensor 2 finishes
    wait_for(lambda: consumer.in_flight == 0)
    consumer.stop(5)

    [dead] = broker.list_dead_letters(topic)
    print(f"dead letter from partition {dead.message.partition}, offset "
          f"{dead.message.offset}: {dead.reason}")
    broker.close()
    if cluster is not None:
        cluster.close()


if __name__ == "__main__":
    main()
