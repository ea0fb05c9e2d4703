"""No module of ``src/msgpatterns`` uses a private name of another module.

The rule, as checked here on the AST of every module:

* A name with one leading underscore (not a dunder) is private to the module that
  defines it. Another module may not import it (``from m import _x``), reach it on an
  imported module (``m._x``), or use it on an object (``obj._x``): a name that this
  module does not define but another module of the package does is another module's
  private member. ``self._x`` and ``cls._x`` are an object's own state and methods (a
  class split into parts - mixins in modules of their own - shares them).
* A module whose own name starts with an underscore (``brokers/redis/_wire.py``,
  ``_redispy.py``) is private to its package: modules of that package and of its
  subpackages may import its public names; modules outside may not import it at all.

Names of other libraries are theirs (``namedtuple._replace``, a client's
``KafkaError._PARTITION_EOF``, ``BlockingChannel._impl``): only names defined in
``msgpatterns`` are checked. A detection on an object is by name, so it is a heuristic:
it misses a private name this module happens to define too, it never reports a name no
other module defines.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

SRC = Path(__file__).parent.parent / "src"

#: Names the check must not report, each with its reason.
ALLOWED = {
    # collections.namedtuple's public API, spelled with an underscore so that it cannot
    # clash with a field (msgpatterns.ordering.routes has a method of that name too).
    (None, "_replace"),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _modules(root: Path) -> dict[str, tuple[bool, ast.Module]]:
    """Every module under ``root`` (a package directory) by dotted name: whether it is
    a package ``__init__``, and its AST."""
    out: dict[str, tuple[bool, ast.Module]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        init = parts[-1] == "__init__"
        if init:
            parts = parts[:-1]
        out[".".join(parts)] = (init, ast.parse(path.read_text(encoding="utf-8"), str(path)))
    return out


def _defined(tree: ast.Module) -> set[str]:
    """The private names a module defines: functions, classes, assigned names and
    arguments, attributes it assigns on ``self``/``cls``, names it imports."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            out.add(node.attr)
        elif isinstance(node, ast.arg):
            out.add(node.arg)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            out.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return {name for name in out if _private(name)}


def _outside(importer: str, module: str) -> str | None:
    """The package ``module`` is private to, if ``importer`` is outside it."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if _private(part):
            owner = ".".join(parts[:i])
            inside = importer == owner or importer.startswith(owner + ".")
            return None if inside else owner
    return None


def violations(root: Path) -> list[str]:
    """Each use of another module's private name in the package at ``root``, as
    ``"<module>:<line>: <what>"``."""
    modules = _modules(root)
    package = root.name
    defined = {name: _defined(tree) for name, (_, tree) in modules.items()}
    owners: dict[str, set[str]] = {}
    for name, names in defined.items():
        for private in names:
            owners.setdefault(private, set()).add(name)
    found: list[str] = []

    def report(module: str, node: ast.AST, what: str, name: str) -> None:
        if (None, name) not in ALLOWED and (module, name) not in ALLOWED:
            found.append(f"{module}:{getattr(node, 'lineno', 0)}: {what}")

    for name, (init, tree) in modules.items():
        here = name if init else name.rpartition(".")[0]
        imported: dict[str, str] = {}  # local name -> module it binds
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source != package and not source.startswith(package + "."):
                    continue
                for alias in node.names:
                    full = f"{source}.{alias.name}"
                    if full in modules:
                        imported[alias.asname or alias.name] = full
                    owner = _outside(name, full if full in modules else source)
                    if owner is not None:
                        report(name, node, f"imports {full} (private to {owner})",
                               alias.name)
                    elif full not in modules and _private(alias.name):
                        report(name, node, f"from {source} import {alias.name}", alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name == package or alias.name.startswith(package + "."):
                        imported[alias.asname or alias.name.split(".")[0]] = alias.name
                        owner = _outside(name, alias.name)
                        if owner is not None:
                            report(name, node, f"imports {alias.name} (private to "
                                   f"{owner})", alias.name)
        own = defined[name]
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id in ("self", "cls"):
                continue
            if isinstance(value, ast.Name) and imported.get(value.id) in modules:
                report(name, node, f"{value.id}.{node.attr} (a private name of "
                       f"{imported[value.id]})", node.attr)
            elif node.attr not in own and owners.get(node.attr, set()) - {name}:
                others = ", ".join(sorted(owners[node.attr] - {name}))
                report(name, node, f"{ast.unparse(value)}.{node.attr} (private to "
                       f"{others})", node.attr)
    return found


def test_no_module_uses_a_private_name_of_another() -> None:
    assert len(_modules(SRC / "msgpatterns")) > 150  # the whole package was read
    assert violations(SRC / "msgpatterns") == []


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _whats(found: Iterable[str]) -> list[str]:
    return sorted(line.split(": ", 1)[1] for line in found)


def test_the_check_finds_each_kind_of_use(tmp_path: Path) -> None:
    """The check itself: each kind of use is reported, the allowed ones are not."""
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": ("_secret = 1\n"
                 "class A:\n"
                 "    def __init__(self):\n"
                 "        self._state = 0\n"
                 "    def _step(self):\n"
                 "        return self._state\n"),
        "b.py": ("from pkg.a import _secret\n"
                 "from pkg import a\n"
                 "def f(obj):\n"
                 "    return a._secret, obj._step(), obj._state, obj._unknown\n"),
        "sub/__init__.py": "",
        "sub/_core.py": "def helper():\n    return 1\n",
        "sub/user.py": "from pkg.sub._core import helper\n",
        "c.py": "from pkg.sub._core import helper\nfrom pkg.sub import _core\n",
    })
    assert _whats(violations(root)) == sorted([
        "from pkg.a import _secret",
        "a._secret (a private name of pkg.a)",
        "obj._step (private to pkg.a)",
        "obj._state (private to pkg.a)",
        "imports pkg.sub._core.helper (private to pkg.sub)",
        "imports pkg.sub._core (private to pkg.sub)",
    ])
