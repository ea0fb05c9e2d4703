"""Consumer runtime overhead: Consumer + InMemoryBroker vs a bare loop, same run.

The bare loop calls the same no-op handler on already-built messages; the difference
is what the runtime adds per message (fetch, flow control, ack deadline, settlement,
retry decision, broker ack). Goal: at most 20 us added per message.

    python benchmarks/bench_runtime.py [--messages N] [--repeats R]
"""

from __future__ import annotations

import argparse

from _bench import bench_line, best_of, timed

from msgpatterns import Consumer, InMemoryBroker, Message


def noop(message: Message) -> None:
    pass


def run_ours(n: int, workers: int) -> float:
    broker = InMemoryBroker(record_history=False)
    for i in range(n):
        broker.publish("bench", i)
    broker.published.clear()
    consumer = Consumer(broker, noop, topics=["bench"], group="g", workers=workers,
                        max_in_flight=256)
    elapsed = timed(lambda: consumer.run_until_idle(timeout=600))
    assert len(broker.acked) == n and broker.pending == 0, consumer.stats
    return elapsed


def run_bare(n: int) -> float:
    messages = [Message(i, id=str(i)) for i in range(n)]

    def loop() -> None:
        for m in messages:
            noop(m)

    return timed(loop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = args.messages
    bare = best_of(args.repeats, lambda: run_bare(n))
    for workers in (1, 4):
        ours = best_of(args.repeats, lambda w=workers: run_ours(n, w))
        added_us = (ours - bare) / n * 1e6
        print(
            f"workers={workers}: consumer {n / ours:,.0f} msg/s, bare loop {n / bare:,.0f} msg/s,"
            f" added {added_us:.2f} us/message"
        )
        bench_line(
            "runtime", f"added_us_per_message_workers_{workers}", ours / n * 1e6,
            bare / n * 1e6, ours / bare, "added <= 20 us/message", added_us <= 20,
            added_us=round(added_us, 3), msgs_per_s=round(n / ours),
        )


if __name__ == "__main__":
    main()
