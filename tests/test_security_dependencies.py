"""Issue 25 item 9: dependency hygiene, read from pyproject.toml and the source.

* Libraries whose private internals the code uses have an upper bound (the next major)
  in every requirement that names them: redis-py (``redis._parsers``, an asyncio
  connection's ``_writer``), hiredis (its ``Reader`` options) and pika
  (``BlockingChannel._impl``). ``.ci/oldest.sh`` runs their tests on the lower bounds.
* Lower bounds exclude versions with insecure defaults: redis-py 5.x left
  ``ssl_check_hostname`` False (redis-py 6.0.0 made it True).
* Test doubles and test tools (fakeredis, Hypothesis, pytest) are only in ``[testing]``
  and ``[dev]``; ``[all]`` pulls neither; the library imports them only from
  ``msgpatterns.testing``.
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

packaging = pytest.importorskip("packaging.requirements")
from packaging.requirements import Requirement  # noqa: E402
from packaging.version import Version  # noqa: E402

ROOT = Path(__file__).parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]

#: Libraries whose private internals the code uses, with a place that uses them.
INTERNALS = {
    "redis": "src/msgpatterns/_redispy.py",
    "hiredis": "src/msgpatterns/_redispy.py",
    "pika": "src/msgpatterns/brokers/rabbitmq/_channels.py",
}
#: Oldest versions allowed, each excluding an insecure default.
SECURE_LOWER_BOUNDS = {"redis": Version("6.0")}
TEST_TOOLS = {"fakeredis", "hypothesis", "pytest", "pytest-timeout"}
TEST_EXTRAS = {"testing", "dev"}


def requirements(extras: dict[str, list[str]]) -> list[tuple[str, Requirement]]:
    return [(extra, Requirement(text)) for extra, texts in extras.items() for text in texts]


def runtime_requirements() -> list[tuple[str, Requirement]]:
    runtime = {name: texts for name, texts in EXTRAS.items() if name not in TEST_EXTRAS}
    return [("dependencies", Requirement(text)) for text in PROJECT["dependencies"]] + \
        requirements(runtime)


def self_extras(extra: str) -> set[str]:
    """The extras of msgpatterns that ``extra`` pulls (``msgpatterns[a,b]``)."""
    return {name for _, req in requirements({extra: EXTRAS[extra]})
            if req.name == "msgpatterns" for name in req.extras}


def test_libraries_whose_internals_we_use_have_upper_bounds() -> None:
    """Issue 25 item 9: every requirement naming redis-py, hiredis or pika has an
    upper bound (and the code still uses internals of each: else drop it from the
    list)."""
    found = set()
    for extra, req in requirements(EXTRAS) + runtime_requirements():
        if req.name in INTERNALS:
            found.add(req.name)
            assert any(spec.operator in ("<", "<=", "~=", "==") for spec in req.specifier), \
                f"[{extra}] {req} has no upper bound"
    assert found == set(INTERNALS)
    for path in set(INTERNALS.values()):
        assert re.search(r"\._(parsers|writer|impl)\b|\"_writer\"|_reader_options",
                         (ROOT / path).read_text()), path


def test_lower_bounds_exclude_insecure_defaults() -> None:
    """Issue 25 item 9: no allowed redis-py has ssl_check_hostname off by default."""
    for extra, req in requirements(EXTRAS):
        bound = SECURE_LOWER_BOUNDS.get(req.name)
        if bound is None or extra in TEST_EXTRAS:
            continue
        assert not req.specifier.contains(Version("5.2.1"), prereleases=True), f"[{extra}] {req}"
        lowers = [Version(s.version) for s in req.specifier if s.operator in (">=", ">")]
        assert lowers and min(lowers) >= bound, f"[{extra}] {req}"


def test_no_test_tool_in_a_runtime_extra() -> None:
    """Issue 25 item 9: fakeredis, Hypothesis and pytest only in [testing]/[dev]; [all]
    is every runtime extra and no test one."""
    for extra, req in runtime_requirements():
        assert req.name not in TEST_TOOLS, f"[{extra}] pulls the test tool {req}"
    assert not self_extras("all") & TEST_EXTRAS
    assert self_extras("all") == set(EXTRAS) - TEST_EXTRAS - {"all"}
    assert {"fakeredis", "hypothesis"} <= {req.name for _, req in
                                           requirements({"testing": EXTRAS["testing"]})}


def test_the_library_imports_test_tools_only_from_its_testing_package() -> None:
    """Issue 25 item 9: outside msgpatterns.testing no module imports fakeredis,
    Hypothesis or pytest (at any depth: a function-level import counts too)."""
    offenders = []
    for path in (ROOT / "src" / "msgpatterns").rglob("*.py"):
        relative = path.relative_to(ROOT / "src")
        if relative.parts[:2] == ("msgpatterns", "testing"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "require" \
                    and node.args and isinstance(node.args[0], ast.Constant):
                names = [str(node.args[0].value)]  # require("module", "extra")
            for name in names:
                if name.split(".")[0] in {"fakeredis", "hypothesis", "pytest", "_pytest"}:
                    offenders.append(f"{relative}:{node.lineno} {name}")
    assert not offenders, offenders
