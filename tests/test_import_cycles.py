"""No import circles in ``src/msgpatterns``, type-only imports included.

import-linter's contracts (pyproject.toml) leave ``if TYPE_CHECKING:`` imports out: they
never run, so they make no layer depend on another. A circle through one still ties
modules together for a reader and a type checker, so this test builds the import graph
with them (grimp, as import-linter does) and finds every strongly connected set of
modules: there must be none, apart from the imports listed in :data:`PENDING`.
"""

from __future__ import annotations

import sys

import pytest

grimp = pytest.importorskip("grimp")

#: Imports left out of the check, each with the change that removes it. Each must still
#: exist: once it is gone, its line goes too.
PENDING = {
    # The ordered-topics branch moves both modules into msgpatterns.ordered_topics.
    ("msgpatterns.ordering.topic_feed", "msgpatterns.ordering.topic"),
}


def circles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            members = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                members.append(member)
                if member == module:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for module in sorted(graph.modules):
            if module not in index:
                visit(module)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_no_import_circles_type_only_imports_included() -> None:
    graph = grimp.build_graph("msgpatterns", exclude_type_checking_imports=False,
                              cache_dir=None)
    assert len(graph.modules) > 150
    for importer, imported in sorted(PENDING):
        assert graph.direct_import_exists(importer=importer, imported=imported), \
            f"{importer} -> {imported} is gone: drop it from PENDING"
        graph.remove_import(importer=importer, imported=imported)
    assert circles(graph) == []


def test_the_check_finds_a_type_only_circle() -> None:
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(module)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")  # e.g. under TYPE_CHECKING
    graph.add_import(importer="pkg.c", imported="pkg.a")
    assert circles(graph) == [["pkg.a", "pkg.b"]]
