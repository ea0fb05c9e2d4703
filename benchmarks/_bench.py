"""Shared helpers for the benchmark scripts: timing with repeats and the BENCH line."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any


def best_of(repeats: int, run: Callable[[], float]) -> float:
    """The best (smallest) of ``repeats`` timings; ``run`` returns seconds."""
    return min(run() for _ in range(repeats))


def median_of(repeats: int, run: Callable[[], float]) -> float:
    return statistics.median(run() for _ in range(repeats))


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_line(
    bench: str, metric: str, ours: float, baseline: float, ratio: float, goal: str, met: bool,
    **extra: Any,
) -> str:
    """Print and return the machine-readable result line."""
    record = {
        "bench": bench, "metric": metric, "ours": round(ours, 4),
        "baseline": round(baseline, 4), "ratio": round(ratio, 3), "goal": goal, "met": met,
        **extra,
    }
    line = "BENCH " + json.dumps(record)
    print(line, flush=True)
    return line
