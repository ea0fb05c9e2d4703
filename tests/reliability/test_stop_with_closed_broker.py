"""Issue 19 (the Redis sync ordered stop/close race): once the consumer is stopping
and its broker is closed, a message that has not started is handed back instead of
run - its ack could not go out, so running it would only apply its effect once more
on redelivery. Nothing is lost: what was not acked stays pending on the broker.

Deterministic: the first message's handler holds its key until the stop has begun
and the broker is closed; the key's later messages wait behind it in ordered mode."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from msgpatterns import Consumer, InMemoryBroker, Message

pytestmark = pytest.mark.timeout(60)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    give_up = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < give_up, "condition not reached"
        time.sleep(0.005)  # polling a public view; no event to wait for


@pytest.mark.parametrize("close_broker", [True, False])
def test_stopping_with_the_broker_closed_hands_back_instead_of_running(
        close_broker: bool) -> None:
    broker = InMemoryBroker()
    for i in range(6):
        broker.publish("t", f"m{i}".encode(), key="k")
    ran: list[str] = []
    started, release = threading.Event(), threading.Event()

    def handle(message: Message) -> None:
        ran.append(message.raw_body.decode())
        if len(ran) == 1:
            started.set()
            release.wait(10)

    consumer = Consumer(broker, handle, topics=["t"], group="g", ordered=True, workers=2,
                        ack_timeout=0, poll_timeout=0.01)
    consumer.start()
    assert started.wait(10)
    wait_until(lambda: consumer.in_flight == 6)  # all fetched: 1 running, 5 parked
    stopper = threading.Thread(target=consumer.stop, args=(10,))
    stopper.start()
    wait_until(lambda: consumer.health().state == "stopping")
    if close_broker:
        broker.close()
    release.set()
    stopper.join(30)
    assert not stopper.is_alive()
    if close_broker:
        # only the message that had started ran; none of the six was acked (the
        # broker was closed), so all six are still pending there: none lost
        assert ran == ["m0"]
        assert broker.in_flight("g") == 6
    else:
        # a graceful stop with the broker open still lets the parked messages run
        assert ran == [f"m{i}" for i in range(6)]
        assert broker.in_flight("g") == 0
