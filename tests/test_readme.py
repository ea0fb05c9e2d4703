"""The README's five-minute example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def test_readme_python_example_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        result = subprocess.run([sys.executable, "-c", block], cwd=tmp_path,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr


def test_readme_quick_start_has_exactly_two_commands() -> None:
    text = README.read_text()
    quick = text.split("## Quick start", 1)[1].split("##", 1)[0]
    (block,) = re.findall(r"```sh\n(.*?)```", quick, flags=re.S)
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci
