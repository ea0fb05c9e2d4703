"""Prints the reliability totals, one line per combination, at the end of the run."""

from __future__ import annotations

import pytest
from reliability_harness import profile, summary_lines


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    lines = summary_lines()
    if not lines:
        return
    terminalreporter.section(f"reliability totals (profile {profile()})")
    for line in lines:
        terminalreporter.write_line(line)
