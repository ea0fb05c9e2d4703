"""docs/testing.md is product: its examples run here, and they catch the bugs they
claim to catch (the fault-injecting example fails on a non-idempotent handler and
passes on the fixed one; the explorer finds and shrinks the order-unaware
projection)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from msgpatterns.testing import ScheduleFailure

DOC = Path(__file__).resolve().parent.parent / "docs" / "testing.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_fault_example_passes_on_the_idempotent_handler(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_docs_example=python_blocks()[0])
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_the_fault_example_catches_the_non_idempotent_handler(
    pytester: pytest.Pytester,
) -> None:
    example = python_blocks()[0]
    buggy = example.replace("@idempotent(checker)", "", 1)
    assert buggy != example
    pytester.makepyfile(test_docs_example=buggy)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.re_match_lines([r".*order-\d+.*"])  # names the doubled orders


def test_the_explorer_example_finds_and_shrinks_the_order_bug() -> None:
    code = python_blocks()[1]
    with pytest.raises(ScheduleFailure) as failure:
        exec(compile(code, str(DOC), "exec"), {})
    story = str(failure.value)
    assert story.splitlines()[1:] == [
        "  1. deliver m1 key='sku-1' (attempt 1): acked",
        "  2. deliver m0 key='sku-1' (attempt 1): acked",
        "invariant failed: {'sku-1': 1}",
    ]


def test_the_explorer_example_passes_once_fixed() -> None:
    code = python_blocks()[1].replace(
        '    prices[message.key] = message.body["version"]',
        '    if message.body["version"] > prices.get(message.key, 0):\n'
        '        prices[message.key] = message.body["version"]',
    )
    exec(compile(code, str(DOC), "exec"), {})
