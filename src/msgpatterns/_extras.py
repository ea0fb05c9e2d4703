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
    and caches the attribute in ``package``'s namespace."""
    import sys

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
