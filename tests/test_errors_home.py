"""One home for the error classes: every public exception of msgpatterns is reachable
from ``msgpatterns.errors`` under its own name, and the closed errors are one family.

The walk imports every public module of the package (no part of its dotted name starts
with ``_``), so an error class added anywhere later is checked too.
"""

from __future__ import annotations

import importlib
import inspect
import pickle
import pkgutil
from types import ModuleType

import pytest

import msgpatterns
from msgpatterns import errors
from msgpatterns.errors import MissingExtra

#: Documented internals, not public API ("their names may change between releases",
#: msgpatterns.runtime's docstring): their hand-back marker ``Released`` is an outcome
#: the drivers pass between their own parts, never raised to a user.
INTERNAL = ("msgpatterns.runtime",)


def _public_modules() -> list[ModuleType]:
    found: list[ModuleType] = [msgpatterns]
    for info in pkgutil.walk_packages(msgpatterns.__path__, "msgpatterns."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        if info.name.startswith(INTERNAL):
            continue
        try:
            found.append(importlib.import_module(info.name))
        except MissingExtra:  # an optional dependency absent here: nothing to walk
            continue
    return found


def _public_error_classes() -> dict[type[BaseException], set[str]]:
    """Each public exception class -> where it is public: exported (``__all__``), or a
    public name of the module that is its ``__module__``."""
    found: dict[type[BaseException], set[str]] = {}
    for module in _public_modules():
        exported = set(getattr(module, "__all__", ()))
        for name, value in vars(module).items():
            if not (inspect.isclass(value) and issubclass(value, BaseException)):
                continue
            if not value.__module__.startswith("msgpatterns"):
                continue
            if name in exported or (not name.startswith("_")
                                    and value.__module__ == module.__name__):
                found.setdefault(value, set()).add(f"{module.__name__}.{name}")
    return found


def test_every_public_error_class_is_reachable_from_msgpatterns_errors() -> None:
    found = _public_error_classes()
    assert len(found) > 30  # the walk saw the package, not an empty list
    unreachable = {
        f"{cls.__module__}.{cls.__qualname__}": sorted(where)
        for cls, where in found.items()
        if getattr(errors, cls.__name__, None) is not cls or cls.__name__ not in errors.__all__
    }
    assert unreachable == {}


def test_moved_error_classes_keep_their_dead_letter_type_and_pickle() -> None:
    """A class that moved into errors keeps its former ``module.QualName`` (the
    ``error_type`` of dead letters and a wire header) and round-trips through pickle."""
    assert errors.MissingVersion.__module__ == "msgpatterns.ordering.errors"
    assert errors.CheckerClosed.__module__ == "msgpatterns.idempotency.base"
    for cls in _public_error_classes():
        home = importlib.import_module(cls.__module__)
        assert getattr(home, cls.__qualname__) is cls, cls
    error = errors.PartialPublish("2 of 3 confirmed", ["a", None, "c"])
    again = pickle.loads(pickle.dumps(errors.MissingVersion("no version")))
    assert type(again) is errors.MissingVersion and str(again) == "no version"
    assert error.confirmed == 2


CLOSED = [errors.BrokerClosed, errors.CheckerClosed, errors.QueueClosed]


@pytest.mark.parametrize("cls", CLOSED, ids=lambda c: c.__name__)
def test_the_closed_errors_are_one_family(cls: type[Exception]) -> None:
    assert issubclass(cls, errors.ClosedError)
    assert issubclass(cls, RuntimeError)  # as the standard library's executors raise
    with pytest.raises(errors.ClosedError):
        raise cls("closed")


def test_every_closed_error_is_a_closed_error() -> None:
    named = [cls for cls in _public_error_classes() if cls.__name__.endswith("Closed")]
    assert sorted(c.__name__ for c in named) == sorted(c.__name__ for c in CLOSED)
    assert issubclass(errors.BrokerClosed, errors.BrokerError)  # still a broker error
