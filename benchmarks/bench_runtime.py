"""Consumer runtime overhead: Consumer + InMemoryBroker vs a bare loop, same run.

The bare loop calls the same no-op handler on already-built messages; the difference
is what the runtime adds per message (fetch, flow control, ack deadline, settlement,
retry decision, broker ack). Goal: at most 20 us added per message.

Telemetry (issue 14): the same run with telemetry off (no listener: the default), with
OpenTelemetry metrics only (``instrument(tracing=False)``) and with tracing and metrics
on (an SDK ``TracerProvider`` whose spans go through a ``BatchSpanProcessor`` to an
exporter that drops them, and an SDK ``MeterProvider``), and the same with a sampler
that keeps 1% of the traces (``tracing-sampled``, ``ParentBased(TraceIdRatioBased(0.01))``:
what a busy service runs; goal: at most 40 us added per message). The modes alternate within
each repeat so that a noisy machine hits them alike; the figure is the best of the
repeats. Off must stay what it was before the hooks (compare with an older checkout:
``PYTHONPATH=<old>/src python benchmarks/bench_runtime.py --modes off``). Each line
also gives the least CPU time per message over all threads (``time.process_time``),
which a busy machine disturbs less than the wall-clock figure.

    python benchmarks/bench_runtime.py [--messages N] [--repeats R] [--modes off,metrics,tracing]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from _bench import bench_line, timed

from msgpatterns import Consumer, InMemoryBroker, Message


def noop(message: Message) -> None:
    pass


#: The least CPU seconds (every thread of the process) of a run, per (workers, mode).
CPU: dict[tuple[int, str], float] = {}


def run_ours(n: int, workers: int, mode: str = "off") -> float:
    broker = InMemoryBroker(record_history=False)
    for i in range(n):
        broker.publish("bench", i)
    broker.published.clear()
    consumer = Consumer(broker, noop, topics=["bench"], group="g", workers=workers,
                        max_in_flight=256)
    cpu = time.process_time()
    elapsed = timed(lambda: consumer.run_until_idle(timeout=600))
    cpu = time.process_time() - cpu
    CPU[workers, mode] = min(CPU.get((workers, mode), cpu), cpu)
    assert len(broker.acked) == n and broker.pending == 0, consumer.stats
    return elapsed


def run_bare(n: int) -> float:
    messages = [Message(i, id=str(i)) for i in range(n)]

    def loop() -> None:
        for m in messages:
            noop(m)

    return timed(loop)


@contextmanager
def telemetry(mode: str) -> Iterator[None]:
    """Run the block with telemetry ``mode``: off, metrics (no tracing) or tracing."""
    if mode == "off":
        yield
        return
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from msgpatterns.observability import instrument

    class Drop(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    # "tracing-sampled": a sampler that keeps 1% of the traces and drops the rest.
    sampler = ParentBased(TraceIdRatioBased(0.01)) if mode == "tracing-sampled" else None
    tracer_provider = TracerProvider(sampler=sampler)
    tracer_provider.add_span_processor(BatchSpanProcessor(Drop()))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    try:
        with instrument(tracer_provider=tracer_provider, meter_provider=meter_provider,
                        tracing=mode.startswith("tracing")):
            yield
    finally:
        tracer_provider.shutdown()
        meter_provider.shutdown()


def best_by_mode(repeats: int, modes: Sequence[str],
                 run: Callable[[str], float]) -> dict[str, float]:
    best: dict[str, float] = {}
    for _ in range(repeats):
        for mode in modes:
            with telemetry(mode):
                elapsed = run(mode)
            best[mode] = min(best.get(mode, elapsed), elapsed)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="off,metrics,tracing,tracing-sampled",
                        help="comma-separated: off, metrics, tracing (every span kept), "
                             "tracing-sampled (a sampler keeping 1%% of the traces)")
    args = parser.parse_args()
    n = args.messages
    modes = [m for m in args.modes.split(",") if m]
    bare = min(run_bare(n) for _ in range(args.repeats))
    for workers in (1, 4):
        best = best_by_mode(args.repeats, modes,
                            lambda mode, w=workers: run_ours(n, w, mode))
        off = best.get("off")
        for mode, ours in best.items():
            added_us = (ours - bare) / n * 1e6
            cpu_us = CPU[workers, mode] / n * 1e6
            print(
                f"workers={workers} telemetry={mode}: consumer {n / ours:,.0f} msg/s, "
                f"bare loop {n / bare:,.0f} msg/s, added {added_us:.2f} us/message "
                f"(CPU {cpu_us:.2f} us/message, all threads)"
            )
            if mode == "off":
                bench_line(
                    "runtime", f"added_us_per_message_workers_{workers}", ours / n * 1e6,
                    bare / n * 1e6, ours / bare, "added <= 20 us/message", added_us <= 20,
                    added_us=round(added_us, 3), cpu_us=round(cpu_us, 3),
                    msgs_per_s=round(n / ours),
                )
            elif off is not None:
                cost_us = (ours - off) / n * 1e6
                bench_line(
                    "runtime", f"telemetry_{mode}_us_per_message_workers_{workers}",
                    ours / n * 1e6, off / n * 1e6, ours / off, "reported (no goal)", True,
                    added_us=round(added_us, 3), telemetry_us=round(cost_us, 3),
                    msgs_per_s=round(n / ours),
                )


if __name__ == "__main__":
    main()
