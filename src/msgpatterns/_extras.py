"""Import an optional dependency or fail with the extra that provides it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from msgpatterns.errors import MissingExtra


def require(module: str, extra: str) -> ModuleType:
    """Import ``module``; raise :class:`MissingExtra` naming ``extra`` if it is absent."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(extra, module.split(".")[0]) from exc


def lazy_attributes(package: str, modules: dict[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that imports ``modules[name]`` on first access to ``name``
    and caches the attribute in ``package``'s namespace.

    Called while ``package`` is being imported (``__getattr__ = lazy_attributes(
    __name__, {...})``), it also gives the package a ``__dir__`` (unless it has its
    own) that lists the lazy names with the loaded ones, so ``dir()`` and IPython's
    completion show every public name before any is loaded."""
    import sys

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    namespace = vars(sys.modules[package])

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(modules))

    namespace.setdefault("__dir__", __dir__)
    return __getattr__
