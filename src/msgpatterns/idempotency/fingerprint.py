"""Payload fingerprints: the same payload always gives the same fingerprint.

Bytes are hashed as they are; text as UTF-8; anything else (a decoded JSON body) as
canonical JSON (sorted keys, no whitespace), so two equal dicts match regardless of
key order.
"""

from __future__ import annotations

import hashlib
import json

from msgpatterns.errors import ConfigurationError

__all__ = ["fingerprint_of"]


def fingerprint_of(payload: object) -> str:
    """The SHA-256 hex digest of ``payload``.

    Raises :class:`ConfigurationError` for a payload that has no stable byte form
    (pass a ``fingerprint=`` callable returning bytes for such payloads).
    """
    if isinstance(payload, bytes | bytearray | memoryview):
        data = bytes(payload)
    elif isinstance(payload, str):
        data = payload.encode("utf-8", "surrogatepass")
    else:
        try:
            text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"cannot fingerprint a {type(payload).__name__} payload: {exc}; "
                "pass fingerprint=<callable returning bytes>"
            ) from exc
        data = text.encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest()
