"""Stored results: a handler's return value kept with its DONE record (``store_result``).

With ``@idempotent(checker, store_result=True)`` the handler's JSON-serialisable
return value is written with the key's DONE mark, and a duplicate gets it back instead
of running the handler. Every store keeps the same text, made here:

* ``=<json>``: the result, as ``json.dumps(value, ensure_ascii=True, allow_nan=False)``
  - pure ASCII, so NUL, lone surrogates and any Unicode survive every store (Redis
  strings, PostgreSQL ``TEXT``, MySQL ``MEDIUMTEXT``, SQLite);
* ``!<json string>``: no result, and why (too large, not JSON-serialisable): the key is
  DONE all the same, because the handler's effect has happened.

A record without either (written without ``store_result``, or by an older version)
has no result. Asking for a result that is not stored raises :class:`ResultNotStored`.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from msgpatterns.errors import ConfigurationError, MsgPatternsError, Reject

__all__ = [
    "DEFAULT_MAX_RESULT_BYTES",
    "MAX_RESULT_BYTES_LIMIT",
    "ResultNotSerialisable",
    "ResultNotStored",
    "check_max_result_bytes",
    "decode_result",
    "encode_result",
]

log = logging.getLogger("msgpatterns.idempotency")

#: Default largest stored result, in bytes of its JSON text.
DEFAULT_MAX_RESULT_BYTES = 64 * 1024
#: The largest ``max_result_bytes`` accepted (a MySQL ``MEDIUMTEXT`` holds 16 MiB).
MAX_RESULT_BYTES_LIMIT = 8 * 1024 * 1024

_STORED = "="
_NOT_STORED = "!"


class ResultNotSerialisable(MsgPatternsError, TypeError):
    """A handler's result cannot be stored as JSON (its type, a NaN, a cycle, too deep).

    Never raised to the caller whose handler produced it - that effect has happened, so
    the key is marked DONE without a result and this error is logged; its text is kept
    as the reason a duplicate's :class:`ResultNotStored` gives.
    """


class ResultNotStored(Reject):
    """A duplicate asked for the stored result of a DONE key that has none.

    The effect was applied once and is not applied again. The reason says why there is
    no result: it was too large, not JSON-serialisable, or the key was completed
    without ``store_result``. A :class:`~msgpatterns.errors.Reject`: under a
    ``Consumer`` the duplicate is dead-lettered with this reason (pass
    ``on_duplicate`` to handle it otherwise).
    """


def check_max_result_bytes(value: object) -> int:
    """``value`` if it is a usable size limit, else a ConfigurationError."""
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 1 <= value <= MAX_RESULT_BYTES_LIMIT:
        raise ConfigurationError(
            f"max_result_bytes must be an int from 1 to {MAX_RESULT_BYTES_LIMIT}, "
            f"got {value!r}")
    return value


def _type_name(value: object) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" \
        else f"{kind.__module__}.{kind.__qualname__}"


def encode_result(value: object, max_bytes: int, key: str) -> str:
    """The stored text of ``value``: its JSON, or - when it cannot be stored - the
    reason, logged at error level (the key is completed either way)."""
    try:
        text = json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        reason = (f"the result of {key!r} is not JSON-serialisable "
                  f"({_type_name(value)}: {_short(exc)})")
        log.error("%s; the key is DONE without its result and a duplicate will raise "
                  "ResultNotStored", reason, exc_info=ResultNotSerialisable(reason))
        return _NOT_STORED + json.dumps(reason)
    if len(text) > max_bytes:  # ASCII: characters are bytes
        reason = (f"the result of {key!r} is {len(text)} bytes of JSON, over "
                  f"max_result_bytes={max_bytes}")
        log.error("%s; the key is DONE without its result and a duplicate will raise "
                  "ResultNotStored", reason)
        return _NOT_STORED + json.dumps(reason)
    return _STORED + text


def decode_result(stored: str | None, key: str) -> Any:
    """The value a DONE record's stored text holds; :class:`ResultNotStored` if none."""
    if stored and stored[0] == _STORED:
        try:
            return json.loads(stored[1:])
        except (ValueError, RecursionError) as exc:
            raise ResultNotStored(
                f"the stored result of {key!r} cannot be read back: {_short(exc)}") from None
    if stored and stored[0] == _NOT_STORED:
        try:
            reason = str(json.loads(stored[1:]))
        except ValueError:
            reason = "reason unreadable"
        raise ResultNotStored(f"{reason}; the effect was applied once and is not repeated")
    raise ResultNotStored(
        f"idempotency key {key!r} is done but no result was stored with it (completed "
        "without store_result=True, or by an older version); the effect is not repeated")


def is_not_stored(stored: str | None) -> bool:
    """True when ``stored`` records a result that could not be kept."""
    return bool(stored) and stored is not None and stored[0] == _NOT_STORED


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 300 else text[:297] + "..."
