"""Import an optional dependency or fail with the extra that provides it."""

from __future__ import annotations

import importlib
from types import ModuleType

from msgpatterns.errors import MissingExtra


def require(module: str, extra: str) -> ModuleType:
    """Import ``module``; raise :class:`MissingExtra` naming ``extra`` if it is absent."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(extra, module.split(".")[0]) from exc
