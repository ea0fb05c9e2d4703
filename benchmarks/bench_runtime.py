"""Consumer runtime overhead: Consumer + InMemoryBroker vs a bare loop, same run.

The bare loop calls the same no-op handler on already-built messages; the difference
is what the runtime adds per message (fetch, flow control, ack deadline, settlement,
retry decision, broker ack). Goal: at most 20 us added per message.

Each line also gives the least CPU time per message over all threads
(``time.process_time``), which a busy machine disturbs less than the wall-clock figure.
What telemetry adds on top is measured by ``bench_telemetry.py``.

    python benchmarks/bench_runtime.py [--messages N] [--repeats R]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from _bench import bench_line, timed

from msgpatterns import Consumer, InMemoryBroker, Message


def noop(message: Message) -> None:
    pass


#: The least CPU seconds (every thread of the process) of a run, per worker count.
CPU: dict[int, float] = {}


def run_ours(n: int, workers: int) -> float:
    broker = InMemoryBroker(record_history=False)
    for i in range(n):
        broker.publish("bench", i)
    broker.published.clear()
    consumer = Consumer(broker, noop, topics=["bench"], group="g", workers=workers,
                        max_in_flight=256)
    cpu = time.process_time()
    elapsed = timed(lambda: consumer.run_until_idle(timeout=600))
    cpu = time.process_time() - cpu
    CPU[workers] = min(CPU.get(workers, cpu), cpu)
    assert len(broker.acked) == n and broker.pending == 0, consumer.stats
    return elapsed


def run_bare(n: int) -> float:
    messages = [Message(i, id=str(i)) for i in range(n)]

    def loop() -> None:
        for m in messages:
            noop(m)

    return timed(loop)


def best_of_runs(repeats: int, run: Callable[[], float]) -> float:
    return min(run() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    n = args.messages
    bare = min(run_bare(n) for _ in range(args.repeats))
    for workers in (1, 4):
        ours = best_of_runs(args.repeats, lambda w=workers: run_ours(n, w))
        added_us = (ours - bare) / n * 1e6
        cpu_us = CPU[workers] / n * 1e6
        print(
            f"workers={workers}: consumer {n / ours:,.0f} msg/s, "
            f"bare loop {n / bare:,.0f} msg/s, added {added_us:.2f} us/message "
            f"(CPU {cpu_us:.2f} us/message, all threads)"
        )
        bench_line(
            "runtime", f"added_us_per_message_workers_{workers}", ours / n * 1e6,
            bare / n * 1e6, ours / bare, "added <= 20 us/message", added_us <= 20,
            added_us=round(added_us, 3), cpu_us=round(cpu_us, 3),
            msgs_per_s=round(n / ours),
        )


if __name__ == "__main__":
    main()
