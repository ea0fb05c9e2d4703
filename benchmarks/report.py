"""Run the benchmarks and render their BENCH lines as the documentation's benchmarks page.

    python benchmarks/report.py --run        # run every bench_*.py, keep their output
    python benchmarks/report.py              # render docs/benchmarks.md from kept output

Each benchmark script prints ``BENCH {json}`` lines: a measure of ours next to a
baseline measured in the same run, their ratio and the goal. The page shows them as a
table and one plot (ours relative to the baseline per measure, the goal marked), with
the machine and the date of the run. Output of each script is kept in
``benchmarks/results/<script>.txt`` so the page can be re-rendered without re-running.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOCS = HERE.parent / "docs"
PLOT = DOCS / "img" / "benchmarks.png"
PAGE = DOCS / "benchmarks.md"


def run_all(only: list[str]) -> None:
    """Run each benchmark script (or those named in ``only``) and keep its output."""
    RESULTS.mkdir(exist_ok=True)
    for script in sorted(HERE.glob("bench_*.py")):
        if only and script.stem not in only:
            continue
        print(f"running {script.name} ...", flush=True)
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              cwd=HERE.parent, check=False)
        (RESULTS / f"{script.stem}.txt").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            print(f"  {script.name} exited {proc.returncode}; see results/{script.stem}.txt")


def collect() -> list[dict[str, Any]]:
    """Every BENCH record in the kept output, in script order."""
    records: list[dict[str, Any]] = []
    for path in sorted(RESULTS.glob("bench_*.txt")):
        for line in path.read_text().splitlines():
            if line.startswith("BENCH "):
                record = json.loads(line[len("BENCH "):])
                record.setdefault("bench", path.stem)
                records.append(record)
    return records


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()} CPU(s), {cpu}; Python {platform.python_version()} on "
            f"{platform.system()} {platform.release()}")


def plotted(record: dict[str, Any]) -> bool:
    """Measures whose ratio reads "ours relative to the baseline, higher is better";
    those with an absolute goal (microseconds, milliseconds) are in the table only."""
    goal = str(record.get("goal", ""))
    return not any(unit in goal for unit in (" us", " ms", "us/")) and "reported" not in goal


def plot(records: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in records if plotted(r)]
    labels = [f"{r['bench']}: {r['metric']}" for r in records]
    ratios = [float(r["ratio"]) for r in records]
    colors = ["tab:green" if r.get("met") else "tab:red" for r in records]
    height = max(3.0, 0.32 * len(records) + 1.2)
    fig, ax = plt.subplots(figsize=(10, height))
    ax.barh(range(len(records)), ratios, color=colors)
    ax.set_yticks(range(len(records)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("ours / baseline measured in the same run (log scale)\n"
                  "green: goal met, red: missed")
    ax.set_title("msgpatterns benchmarks")
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110, bbox_inches="tight")
    plt.close(fig)


def render(records: list[dict[str, Any]], when: str) -> str:
    lines = [
        "# Benchmarks",
        "",
        "Every figure is a ratio against a baseline measured in the same run on the same",
        "machine (the machines are shared and noisy: absolute times mean little). Each",
        "script in `benchmarks/` prints `BENCH {json}` lines; `python benchmarks/report.py",
        "--run` runs them all and renders this page.",
        "",
        f"Run: {when}. Machine: {machine()}.",
        "",
        "![ours relative to the baseline, per measure](img/benchmarks.png)",
        "",
        "The plot shows the measures whose ratio reads \"higher is better\"; those with an",
        "absolute goal (microseconds added per message, a p99 latency) are in the table.",
        "",
        "| bench | measure | ours | baseline | ratio | goal | met |",
        "| --- | --- | ---: | ---: | ---: | --- | --- |",
    ]
    for r in records:
        lines.append(
            f"| {r['bench']} | {r['metric']} | {r['ours']} | {r['baseline']} | "
            f"{r['ratio']} | {r.get('goal', '')} | {'yes' if r.get('met') else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="run the benchmarks first")
    parser.add_argument("--only", nargs="*", default=[], help="bench script stems to run")
    args = parser.parse_args()
    if args.run:
        run_all(args.only)
    records = collect()
    if not records:
        print("no BENCH lines in benchmarks/results/: run with --run first", file=sys.stderr)
        return 1
    stamp = max(p.stat().st_mtime for p in RESULTS.glob("bench_*.txt"))
    when = dt.datetime.fromtimestamp(stamp, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    plot(records)
    PAGE.write_text(render(records, when))
    print(f"wrote {PAGE.relative_to(HERE.parent)} and {PLOT.relative_to(HERE.parent)} "
          f"({len(records)} measures)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
