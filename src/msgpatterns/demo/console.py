"""What both demos share: the order steps, the result, and the console that prints it
(rich when installed, plain text otherwise)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["STEPS", "Console", "DemoResult"]

#: An order's statuses, in order (versions 1..4).
STEPS = ("created", "paid", "shipped", "delivered")


@dataclass
class DemoResult:
    """What the demo did and whether the final state is exact."""

    published: int
    malformed: int
    summary: dict[str, Any]
    problems: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return not self.problems


class Console:
    """Rich output when ``rich`` is installed, plain text otherwise."""

    def __init__(self, out: Callable[[str], None] | None) -> None:
        self._out = out
        self._rich: Any = None
        if out is None:
            try:
                import rich.console

                self._rich = rich.console.Console()
            except ImportError:
                pass

    def print(self, text: str) -> None:
        (self._out or print)(text)

    def progress(self, runner: threading.Thread, done: Callable[[], int], total: int,
                 *, enabled: bool) -> None:
        if not enabled or self._rich is None:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        with Progress("[progress.description]{task.description}", BarColumn(),
                      MofNCompleteColumn(), TimeElapsedColumn(), console=self._rich) as bar:
            task = bar.add_task("settling messages", total=total)
            while runner.is_alive():
                bar.update(task, completed=done())
                runner.join(0.05)
            bar.update(task, completed=done())

    def summary(self, result: DemoResult, expected: dict[str, Any], dead: list[str]) -> None:
        verdict = (
            f"exact: {len(expected['orders'])} orders, {len(expected['payments'])} payments, "
            "each applied once"
            if result.exact else "MISMATCH: " + "; ".join(result.problems)
        )
        if self._rich is not None:
            from rich.table import Table

            table = Table(title="msgpatterns demo: order-status pipeline")
            table.add_column("what")
            table.add_column("count", justify="right")
            for name, value in result.summary.items():
                table.add_row(name, f"{value:,}" if isinstance(value, int) else str(value))
            self._rich.print(table)
            for line in dead:
                self._rich.print(f"  dead letter: {line}", markup=False, highlight=False)
            style = "bold green" if result.exact else "bold red"
            self._rich.print(f"[{style}]Final state {verdict}[/{style}]")
            return
        width = max(len(k) for k in result.summary)
        for name, value in result.summary.items():
            self.print(f"{name:<{width}}  {value}")
        for line in dead:
            self.print(f"  dead letter: {line}")
        self.print(f"Final state {verdict}")
