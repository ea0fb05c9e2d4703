"""Checks on the callables users hand to msgpatterns, made once where they are given.

A coroutine function given to a sync-only place would "succeed" as soon as the
coroutine object is created, before its body runs: the message would be acked (or a
key marked DONE) and a failure in the body silently lost. So every sync-only place
refuses it at decoration or construction time.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, cast

from msgpatterns.errors import ConfigurationError

__all__ = [
    "is_async_callable",
    "renamed_arguments",
    "require_async_callable",
    "require_sync_callable",
]

F = TypeVar("F", bound=Callable[..., Any])


def renamed_arguments(**old_names: str) -> Callable[[F], F]:
    """Keep old keyword names of a function's arguments working (thin aliases):
    ``@renamed_arguments(client_or_url="url")`` lets callers still write
    ``client_or_url=...``. Giving both spellings raises
    :class:`~msgpatterns.errors.ConfigurationError`. Type checkers see only the new
    names."""

    def decorate(fn: F) -> F:
        positions = {p.name: i for i, p in enumerate(inspect.signature(fn).parameters.values())
                     if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD}

        @functools.wraps(fn)
        def accepting_old_names(*args: Any, **kwargs: Any) -> Any:
            for old, new in old_names.items():
                if old in kwargs:
                    if new in kwargs or positions.get(new, len(args)) < len(args):
                        raise ConfigurationError(
                            f"{fn.__qualname__}: pass {new}= or its old name {old}=, "
                            "not both")
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return cast(F, accepting_old_names)

    return decorate


def is_async_callable(fn: Any) -> bool:
    """True for ``async def`` functions, ``functools.partial`` of them, and objects
    whose ``__call__`` is an ``async def``."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn):
        return True
    bound_call = getattr(fn, "__call__", None)  # noqa: B004 - the method, not callability
    return inspect.iscoroutinefunction(bound_call)


def require_sync_callable(fn: Any, *, what: str, where: str, alternative: str = "") -> None:
    """Refuse ``fn`` unless it is a plain (sync) callable.

    Raises :class:`ConfigurationError` when ``fn`` is not callable, and ``TypeError``
    when it is a coroutine function, naming ``where`` it was given and the async
    ``alternative``.
    """
    if is_async_callable(fn):
        name = getattr(fn, "__qualname__", None) or repr(fn)
        hint = f"; use {alternative} instead" if alternative else (
            "; msgpatterns has no async support here yet: wrap the coroutine in a sync "
            "function that runs it to completion (asyncio.run) if you must"
        )
        raise TypeError(f"{what} {name} is an async def, but {where} only runs sync "
                        f"callables: it would finish before the coroutine body ran{hint}")
    if not callable(fn):
        raise ConfigurationError(f"{what} must be callable, got {fn!r} for {where}")


def require_async_callable(fn: Any, *, what: str, where: str, alternative: str) -> None:
    """Refuse ``fn`` unless it is a coroutine function: a sync one would block the
    event loop (and its result could not be awaited).

    Raises :class:`ConfigurationError` when ``fn`` is not callable, and ``TypeError``
    when it is a plain function, naming ``where`` it was given and the sync
    ``alternative``.
    """
    if not callable(fn):
        raise ConfigurationError(f"{where} {what} must be callable, got {fn!r}")
    if not is_async_callable(fn):
        name = getattr(fn, "__qualname__", None) or repr(fn)
        raise TypeError(
            f"{what} {name} is not an async def, but {where} runs coroutine functions on "
            f"the event loop (a sync {what} would block it); use {alternative} for a sync "
            f"{what}"
        )
