"""Telemetry cost per message: the same consumer run with telemetry off (the baseline,
measured in the same run) and with each OpenTelemetry mode on.

Every run is ``Consumer`` + ``InMemoryBroker`` (one worker, ``max_in_flight=256``) on
``--messages`` pre-published messages with a no-op handler, so what a mode adds is the
telemetry alone. Modes:

* ``off``: no listener installed (the default): the baseline.
* ``metrics``: ``instrument(tracing=False)`` with an SDK ``MeterProvider``: exact
  counters, the duration histogram sampled (``duration_sample_rate`` 0.1, the default).
  Goal: at most 5 us of CPU added per message (issue 24).
* ``metrics-exact``: the same with ``duration_sample_rate=1.0`` (every delivery's
  duration recorded): reported, to show what the sampling saves.
* ``tracing-dropped``: tracing and metrics, with a sampler that keeps 1% of the traces
  (``ParentBased(TraceIdRatioBased(0.01))``: what a busy service runs). Goal: at most
  40 us of CPU added per message.
* ``tracing``: every span kept and handed to a ``BatchSpanProcessor`` whose exporter
  drops them: reported.

The modes alternate within each of ``--repeats`` rounds (so a loaded machine hits them
alike). Per mode: the median over rounds of wall-clock and CPU microseconds per message
(``time.process_time``: every thread of the process, which load disturbs less than the
wall clock), and the added cost against ``off`` of the same round (median of the
rounds' differences). ``--instructions`` counts instructions instead, under
``valgrind --tool=callgrind``: each mode runs in a child process at N and 2N messages,
and (I(2N) - I(N)) / N is the instructions per message, free of start-up costs; the
machine's load does not change it.

    python benchmarks/bench_telemetry.py [--messages N] [--repeats R] [--modes a,b]
    python benchmarks/bench_telemetry.py --instructions [--messages N]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from _bench import bench_line

from msgpatterns import Consumer, InMemoryBroker, Message

MODES = ("off", "metrics", "metrics-exact", "tracing-dropped", "tracing")
#: mode -> (goal text, most microseconds of CPU added per message); None: reported only.
GOALS: dict[str, tuple[str, float] | None] = {
    "metrics": ("<= +5 us CPU/message", 5.0),
    "metrics-exact": None,
    "tracing-dropped": ("<= +40 us CPU/message", 40.0),
    "tracing": None,
}


def noop(message: Message) -> None:
    pass


@contextmanager
def telemetry(mode: str) -> Iterator[None]:
    """Run the block with telemetry ``mode`` (see the module docstring)."""
    if mode == "off":
        yield
        return
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    from msgpatterns.observability import instrument

    class Drop(SpanExporter):
        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    tracing = mode.startswith("tracing")
    sampler = ParentBased(TraceIdRatioBased(0.01)) if mode == "tracing-dropped" else None
    tracer_provider = TracerProvider(sampler=sampler)
    tracer_provider.add_span_processor(BatchSpanProcessor(Drop()))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    options: dict[str, Any] = {"duration_sample_rate": 1.0} if mode == "metrics-exact" else {}
    try:
        with instrument(tracer_provider=tracer_provider, meter_provider=meter_provider,
                        tracing=tracing, **options):
            yield
    finally:
        tracer_provider.shutdown()
        meter_provider.shutdown()


def consume(n: int, mode: str) -> tuple[float, float]:
    """Wall and CPU seconds to consume ``n`` messages with telemetry ``mode``."""
    broker = InMemoryBroker(record_history=False)
    for i in range(n):
        broker.publish("bench", i)
    broker.published.clear()
    with telemetry(mode):
        consumer = Consumer(broker, noop, topics=["bench"], group="g", workers=1,
                            max_in_flight=256)
        cpu = time.process_time()
        wall = time.perf_counter()
        consumer.run_until_idle(timeout=600)
        wall = time.perf_counter() - wall
        cpu = time.process_time() - cpu
    assert len(broker.acked) == n and broker.pending == 0, consumer.stats
    return wall, cpu


def timed_rounds(n: int, repeats: int, modes: Sequence[str]) -> None:
    consume(min(n, 2000), "metrics")  # warm-up: imports, first series
    wall: dict[str, list[float]] = {mode: [] for mode in modes}
    cpu: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode in modes:
            w, c = consume(n, mode)
            wall[mode].append(w / n * 1e6)
            cpu[mode].append(c / n * 1e6)
    print(f"{n:,} messages, {repeats} rounds, load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores; medians, us per message", flush=True)
    for mode in modes:
        print(f"  {mode:16s} wall {statistics.median(wall[mode]):7.2f}  "
              f"CPU {statistics.median(cpu[mode]):7.2f}", flush=True)
    if "off" not in modes:
        return
    for mode in modes:
        if mode == "off":
            continue
        added_cpu = statistics.median(c - o for c, o in zip(cpu[mode], cpu["off"], strict=True))
        added_wall = statistics.median(w - o for w, o in zip(wall[mode], wall["off"],
                                                               strict=True))
        ours, base = statistics.median(cpu[mode]), statistics.median(cpu["off"])
        print(f"  {mode}: +{added_cpu:.2f} us CPU, +{added_wall:.2f} us wall per message "
              f"over off", flush=True)
        goal = GOALS.get(mode)
        bench_line("telemetry", f"{mode}_cpu_us_per_message", ours, base, ours / base,
                   goal[0] if goal else "reported (no goal)",
                   added_cpu <= goal[1] if goal else True,
                   added_cpu_us=round(added_cpu, 2), added_wall_us=round(added_wall, 2),
                   wall_us=round(statistics.median(wall[mode]), 2),
                   off_wall_us=round(statistics.median(wall["off"]), 2),
                   messages=n, rounds=repeats)


def instructions(n: int, modes: Sequence[str]) -> None:
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("--instructions needs valgrind")
        return
    per_message: dict[str, float] = {}
    for mode in modes:
        counts = [_callgrind(valgrind, mode, size) for size in (n, 2 * n)]
        per_message[mode] = (counts[1] - counts[0]) / n
        print(f"  {mode:16s} {per_message[mode]:,.0f} instructions per message", flush=True)
    if "off" not in per_message:
        return
    base = per_message["off"]
    for mode, count in per_message.items():
        if mode == "off":
            continue
        print(f"  {mode}: +{count - base:,.0f} instructions per message over off "
              f"({count / base:.2f}x)", flush=True)
        bench_line("telemetry", f"{mode}_instructions_per_message", count, base,
                   count / base, "reported (callgrind)", True,
                   added_instructions=round(count - base), messages=n)


def _callgrind(valgrind: str, mode: str, n: int) -> int:
    """Instructions of a child process that consumes ``n`` messages in ``mode``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        subprocess.run([valgrind, "--tool=callgrind", f"--callgrind-out-file={out}",
                        sys.executable, __file__, "--child", mode, "--messages", str(n)],
                       check=True, capture_output=True)
        with open(out) as f:
            text = f.read()
    found = re.search(r"^summary:\s+(\d+)", text, re.MULTILINE) or \
        re.search(r"^totals:\s+(\d+)", text, re.MULTILINE)
    assert found is not None, "no summary in the callgrind output"
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated subset of {', '.join(MODES)}")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions under callgrind instead of timing")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        consume(args.messages, args.child)
        return
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        parser.error(f"unknown modes: {', '.join(sorted(unknown))}")
    if args.instructions:
        instructions(args.messages, modes)
    else:
        timed_rounds(args.messages, args.repeats, modes)


if __name__ == "__main__":
    main()
