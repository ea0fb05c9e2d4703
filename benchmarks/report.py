"""Run the benchmarks and render their BENCH lines as the documentation's benchmarks page.

    python benchmarks/report.py --run        # run every bench_*.py, keep their output
    python benchmarks/report.py              # render docs/benchmarks.md from kept output

Each benchmark script prints ``BENCH {json}`` lines: a measure of ours next to a
baseline measured in the same run, their ratio and the goal. The page has one section
per script: a plot (ours relative to the baseline per measure, the goal marked) drawn as
an SVG at the page's width (click it to open it full size), then the table; with the
machine and the date of the run. Output of each script is kept in
``benchmarks/results/<script>.txt`` so the page can be re-rendered without re-running.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOCS = HERE.parent / "docs"
PLOTS = DOCS / "img" / "benchmarks"
PAGE = DOCS / "benchmarks.md"
MACHINE = RESULTS / "machine.txt"

# Section titles, in page order; a script not named here gets its own name.
GROUPS = {
    "bench_async": "asyncio consumer",
    "bench_async_kafka": "asyncio Kafka",
    "bench_runtime": "Runtime overhead",
    "bench_telemetry": "Telemetry",
    "bench_idempotency": "Idempotency",
    "bench_batching": "Batching",
    "bench_ordering": "Ordering",
    "bench_ordered_topics": "Ordered topics",
    "bench_brokers": "Brokers",
    "bench_peers": "Against FastStream and Dramatiq",
    "bench_spark": "Spark",
}


def run_all(only: list[str]) -> None:
    """Run each benchmark script (or those named in ``only``) and keep its output, and
    the machine it ran on."""
    RESULTS.mkdir(exist_ok=True)
    MACHINE.write_text(machine() + "\n")
    for script in sorted(HERE.glob("bench_*.py")):
        if only and script.stem not in only:
            continue
        print(f"running {script.name} ...", flush=True)
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              cwd=HERE.parent, check=False)
        (RESULTS / f"{script.stem}.txt").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            print(f"  {script.name} exited {proc.returncode}; see results/{script.stem}.txt")


def notes(script: str) -> list[str]:
    """The ``# ...`` lines kept with a script's output: when and how it ran, figures
    from other runs (an A/B against an older version, the load)."""
    path = RESULTS / f"{script}.txt"
    if not path.exists():
        return []
    return [line[1:].strip() for line in path.read_text().splitlines()
            if line.startswith("#") and line[1:].strip()]


def collect() -> list[dict[str, Any]]:
    """Every BENCH record in the kept output, in script order."""
    records: list[dict[str, Any]] = []
    for path in sorted(RESULTS.glob("bench_*.txt")):
        for line in path.read_text().splitlines():
            if line.startswith("BENCH "):
                record = json.loads(line[len("BENCH "):])
                record.setdefault("bench", path.stem)
                record["script"] = path.stem
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


def recorded_machine() -> str:
    """The machine the kept results ran on (this one if it was not recorded)."""
    try:
        return MACHINE.read_text().strip()
    except OSError:
        return machine()


def plotted(record: dict[str, Any]) -> bool:
    """Measures whose ratio reads "ours relative to the baseline, higher is better";
    those with an absolute goal (microseconds, milliseconds) are in the table only."""
    goal = str(record.get("goal", ""))
    return not any(unit in goal for unit in (" us", " ms", "us/")) and "reported" not in goal


def groups(records: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    """The records per script, in the page's order."""
    by_script: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_script.setdefault(record["script"], []).append(record)
    order = list(GROUPS)
    return sorted(by_script.items(),
                  key=lambda item: (order.index(item[0]) if item[0] in order else len(order),
                                    item[0]))


def wrap(text: str, width: int = 34) -> str:
    """``text`` on lines of at most ``width`` characters, broken after a space, ``_`` or ``.``."""
    lines = [""]
    for token in re.split(r"(?<=[ _.,])", text):
        if lines[-1] and len(lines[-1]) + len(token.rstrip()) > width:
            lines.append("")
        lines[-1] += token
    return "\n".join(line.strip() for line in lines)


def goal_ratio(record: dict[str, Any]) -> float | None:
    """The ratio the goal asks for (``>= 5x ...`` -> 5.0), when it states one."""
    match = re.match(r"\s*>=?\s*([0-9.]+)", str(record.get("goal", "")))
    return float(match.group(1)) if match else None


def plot_labels(script: str, records: list[dict[str, Any]]) -> list[str]:
    """One label per bar: the measure, without the part every bar of the group shares."""
    prefix = script.removeprefix("bench_")
    labels: list[str] = []
    for record in records:
        bench = str(record["bench"])
        if bench == prefix or bench.startswith(prefix + "."):
            bench = bench[len(prefix):].lstrip(".")
        label = f"{bench}: {record['metric']}" if bench else str(record["metric"])
        repeat = labels.count(label) + sum(1 for lab in labels if lab.startswith(label + " ("))
        labels.append(f"{label} ({repeat + 1})" if repeat else label)
    return [wrap(label) for label in labels]


def plot_path(script: str) -> Path:
    return PLOTS / f"{script}.svg"


def plot(script: str, records: list[dict[str, Any]]) -> Path | None:
    """Draw one group's "higher is better" measures as an SVG sized for the page."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    records = [r for r in records if plotted(r)]
    if not records:
        return None
    labels = plot_labels(script, records)
    ratios = [float(r["ratio"]) for r in records]
    colors = ["tab:green" if r.get("met") else "tab:red" for r in records]
    lines = sum(label.count("\n") + 1 for label in labels)
    # Glyphs as paths: the browser draws the text exactly as laid out, in any font setup.
    style = {"svg.fonttype": "path", "svg.hashsalt": script, "font.size": 11}
    with plt.rc_context(style):
        # 7 in (672 px) is about the content column's width: the SVG is shown near 1:1,
        # so 10-11 pt text reads as 13-15 px. Constrained layout keeps the labels inside.
        fig, ax = plt.subplots(figsize=(7.0, 1.3 + 0.19 * lines + 0.22 * len(records)),
                               layout="constrained")
        y = range(len(records))
        ax.barh(y, ratios, color=colors, height=0.6)
        ax.set_yticks(y, labels, fontsize=10)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}x"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        goals = [goal_ratio(r) for r in records]
        shown = [v for v in ratios + [g for g in goals if g] + [1.0] if v > 0]
        ax.set_xlim(min(shown) / 1.6, max(shown) * 2.5)
        ax.axvline(1.0, color="black", linewidth=0.8)
        for i, (ratio, goal) in enumerate(zip(ratios, goals, strict=True)):
            ax.annotate(f"{ratio:.3g}x", (max(ratio, goal or 0), i), xytext=(5, 0),
                        textcoords="offset points",
                        va="center", fontsize=10)
            if goal:
                ax.plot([goal, goal], [i - 0.4, i + 0.4], color="black", linewidth=2.5)
        fig.supxlabel("ours / baseline in the same run (log scale); black tick: the goal",
                      fontsize=10)
        ax.set_title(GROUPS.get(script, script), fontsize=12)
        ax.grid(axis="x", which="major", color="0.9")
        ax.set_axisbelow(True)
        path = plot_path(script)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, metadata={"Date": None})
        plt.close(fig)
    return path


def run_time() -> str:
    """When the kept results were made: their commit time if unchanged since, else the
    newest file time."""
    stamp = max(p.stat().st_mtime for p in RESULTS.glob("bench_*.txt"))
    kept = str(RESULTS / "bench_*.txt")
    try:
        dirty = subprocess.run(["git", "status", "--porcelain", "--", kept],
                               capture_output=True, text=True, check=True, cwd=HERE).stdout
        committed = subprocess.run(["git", "log", "-1", "--format=%ct", "--", kept],
                                   capture_output=True, text=True, check=True, cwd=HERE).stdout
        if not dirty.strip() and committed.strip():
            stamp = float(committed)
    except (OSError, subprocess.CalledProcessError):
        pass
    return dt.datetime.fromtimestamp(stamp, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


#: Figures a BENCH line may carry beside its ratio, shown in the "beside" column: the
#: ones a loaded machine disturbs less than the wall clock (CPU, instructions, round
#: trips). key -> (label, the baseline's key or None).
BESIDE = {
    "cpu_us": ("CPU us/msg", "baseline_cpu_us"),
    "cpu_us_per_msg_ours": ("CPU us/msg", "cpu_us_per_msg_baseline"),
    "cpu_us_per_message": ("CPU us/msg", None),
    "added_cpu_us": ("CPU us/msg added", None),
    "added_instructions": ("instructions/msg added", None),
    "round_trips": ("round trips/msg", "baseline_round_trips"),
}


def beside(record: dict[str, Any]) -> str:
    """The record's CPU, instruction and round-trip figures, ours vs the baseline's."""
    parts = []
    for key, (label, base_key) in BESIDE.items():
        if key not in record:
            continue
        text = f"{label} {record[key]:,}"
        if base_key is not None and base_key in record:
            text += f" vs {record[base_key]:,}"
        parts.append(text)
    return "; ".join(parts)


def render(records: list[dict[str, Any]], when: str,
           plots: dict[str, Path | None]) -> str:
    lines = [
        "# Benchmarks",
        "",
        "Every figure is a ratio against a baseline measured in the same run on the same",
        "machine (the machines are shared and noisy: absolute times mean little). Each",
        "script in `benchmarks/` prints `BENCH {json}` lines; `python benchmarks/report.py",
        "--run` runs them all and renders this page.",
        "",
        f"Run: {when}. Machine: {recorded_machine()}.",
        "",
        "Each section plots the measures whose ratio reads \"higher is better\" (green: goal",
        "met, red: missed; the black tick is the goal); click a plot to open it full size.",
        "Those with an absolute goal (microseconds added per message, a p99 latency) are in",
        "the tables only. The \"beside\" column gives what a loaded machine disturbs less than",
        "the wall clock, where the script measured it: client CPU per message (ours vs the",
        "baseline's), instructions per message (callgrind) and round trips per message.",
    ]
    for script, group in groups(records):
        lines += ["", f"## {GROUPS.get(script, script)}", ""]
        path = plots.get(script)
        if path is not None:
            src = path.relative_to(DOCS).as_posix()
            title = GROUPS.get(script, script)
            lines += [f"[![{title}: ours relative to the baseline, per measure]({src})]({src})",
                      ""]
        lines += [
            "| bench | measure | ours | baseline | ratio | goal | met | beside |",
            "| --- | --- | ---: | ---: | ---: | --- | --- | --- |",
        ]
        for r in group:
            lines.append(
                f"| {r['bench']} | {r['metric']} | {r['ours']} | {r['baseline']} | "
                f"{r['ratio']} | {r.get('goal', '')} | {'yes' if r.get('met') else '**no**'} "
                f"| {beside(r)} |"
            )
        kept = notes(script)
        if kept:
            lines += ["", "Notes kept with this run:", ""]
            lines += [f"- {note}" for note in kept]
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
    for old in PLOTS.glob("*.svg"):
        old.unlink()
    plots = {script: plot(script, group) for script, group in groups(records)}
    PAGE.write_text(render(records, run_time(), plots))
    drawn = sum(1 for path in plots.values() if path is not None)
    print(f"wrote {PAGE.relative_to(HERE.parent)} and {drawn} plots in "
          f"{PLOTS.relative_to(HERE.parent)} ({len(records)} measures)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
