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

**Integrity.** A stored result is only as trustworthy as the store: anyone who can
write to it (the Redis instance, the dedup table) chooses what a duplicate gets back.
Setting a checker's ``result_key`` (a secret of at least 16 bytes, shared by every
process that completes or reads the same keys) signs every stored text with an
HMAC-SHA256 bound to its store key: ``#<64 hex digits><text>``. A duplicate then gets
back only a result some holder of the key stored *for that key*; anything else (a
forged, altered, unsigned or moved result) raises :class:`ResultIntegrityError`, never
returns the value. Without ``result_key`` a signed text is read without checking it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from typing import Any

from msgpatterns._escape import escape_control
from msgpatterns.errors import (
    ConfigurationError,
    ResultIntegrityError,
    ResultNotSerialisable,
    ResultNotStored,
)

__all__ = [
    "DEFAULT_MAX_RESULT_BYTES",
    "MAX_RESULT_BYTES_LIMIT",
    "MIN_RESULT_KEY_BYTES",
    "ResultIntegrityError",
    "ResultNotSerialisable",
    "ResultNotStored",
    "SignsResults",
    "check_max_result_bytes",
    "check_result_key",
    "decode_result",
    "encode_result",
]

log = logging.getLogger("msgpatterns.idempotency")

#: Default largest stored result, in bytes of its JSON text.
DEFAULT_MAX_RESULT_BYTES = 64 * 1024
#: The largest ``max_result_bytes`` accepted (a MySQL ``MEDIUMTEXT`` holds 16 MiB).
MAX_RESULT_BYTES_LIMIT = 8 * 1024 * 1024

#: The shortest ``result_key`` accepted, in bytes.
MIN_RESULT_KEY_BYTES = 16

_STORED = "="
_NOT_STORED = "!"
_SIGNED = "#"
_MAC_CHARS = 64  # HMAC-SHA256, hex


def check_result_key(value: object) -> bytes | None:
    """``value`` as an HMAC key (None: no signing), else a ConfigurationError."""
    if value is None:
        return None
    if not isinstance(value, bytes | bytearray) or len(value) < MIN_RESULT_KEY_BYTES:
        raise ConfigurationError(
            f"result_key must be bytes of at least {MIN_RESULT_KEY_BYTES} (e.g. "
            "secrets.token_bytes(32), shared by every process using the store) or None, "
            f"got {type(value).__name__}" + (f" of {len(value)} bytes"
                                              if isinstance(value, bytes | bytearray) else ""))
    return bytes(value)


class SignsResults:
    """The ``result_key`` option every checker has (see the module docstring): set it
    to a secret to sign stored results and refuse any that fails its check."""

    _result_key: bytes | None = None

    @property
    def result_key(self) -> bytes | None:
        """The HMAC key stored results are signed and checked with (None: unsigned).
        Set it before the checker's first use; never shown in a repr."""
        return self._result_key

    @result_key.setter
    def result_key(self, value: bytes | None) -> None:
        self._result_key = check_result_key(value)


def _mac(result_key: bytes, key: str, text: str) -> str:
    """The HMAC-SHA256 of ``text`` stored for the store key ``key`` (length-prefixed,
    so no key/text split is ambiguous)."""
    key_bytes = key.encode("utf-8", "surrogatepass")
    data = b"msgpatterns.result.v1\0%d:" % len(key_bytes) + key_bytes + \
        text.encode("utf-8", "surrogatepass")
    return hmac.new(result_key, data, hashlib.sha256).hexdigest()


def _signed(text: str, key: str, result_key: bytes | None) -> str:
    return text if result_key is None else _SIGNED + _mac(result_key, key, text) + text


def _verified(stored: str | None, key: str, result_key: bytes | None) -> str | None:
    """The text inside ``stored``: checked against ``result_key`` when there is one
    (:class:`ResultIntegrityError` unless it is signed for ``key``); without one, a
    signature is dropped unchecked."""
    if not stored:
        return stored
    signed = stored[0] == _SIGNED and len(stored) > _MAC_CHARS + 1
    if result_key is None:
        return stored[_MAC_CHARS + 1:] if signed else stored
    if signed:
        text = stored[_MAC_CHARS + 1:]
        if hmac.compare_digest(stored[1:_MAC_CHARS + 1], _mac(result_key, key, text)):
            return text
    raise ResultIntegrityError(
        f"the stored result of {key!r} failed its integrity check (result_key): it was "
        "not written by a holder of the key for this key - it is not returned; the "
        "effect was applied once and is not repeated")


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


def encode_result(value: object, max_bytes: int, key: str,
                  result_key: bytes | None = None) -> str:
    """The stored text of ``value``: its JSON, or - when it cannot be stored - the
    reason, logged at error level (the key is completed either way); signed for the
    store key ``key`` with ``result_key`` when one is given."""
    return _signed(_encoded(value, max_bytes, key), key, result_key)


def _encoded(value: object, max_bytes: int, key: str) -> str:
    try:
        text = json.dumps(value, ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        reason = (f"the result of {key!r} is not JSON-serialisable "
                  f"({_type_name(value)}: {_short(exc)})")
        log.error("%s; the key is DONE without its result and a duplicate will raise "
                  "ResultNotStored", escape_control(reason),
                  exc_info=ResultNotSerialisable(reason))
        return _NOT_STORED + json.dumps(reason)
    if len(text) > max_bytes:  # ASCII: characters are bytes
        reason = (f"the result of {key!r} is {len(text)} bytes of JSON, over "
                  f"max_result_bytes={max_bytes}")
        log.error("%s; the key is DONE without its result and a duplicate will raise "
                  "ResultNotStored", escape_control(reason))
        return _NOT_STORED + json.dumps(reason)
    return _STORED + text


def decode_result(stored: str | None, key: str, result_key: bytes | None = None) -> Any:
    """The value a DONE record's stored text holds; :class:`ResultNotStored` if none;
    :class:`ResultIntegrityError` when ``result_key`` is given and the text is not
    signed with it for the store key ``key``."""
    stored = _verified(stored, key, result_key)
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
    """True when ``stored`` (as :func:`encode_result` made it, signed or not) records
    a result that could not be kept."""
    if stored and stored[0] == _SIGNED:
        stored = stored[_MAC_CHARS + 1:]
    return bool(stored) and stored is not None and stored[0] == _NOT_STORED


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= 300 else text[:297] + "..."
