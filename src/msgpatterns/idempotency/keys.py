"""Store keys: ``namespace:group:key``, never truncated, never colliding.

A message's key is data: it may hold quotes, ``*``, ``:``, braces, spaces, any
Unicode, or be ten kilobytes long. :class:`KeyBuilder` keeps it verbatim when it fits
the store and replaces it by ``sha256:<hex digest>`` when it does not. Two different
keys of one namespace and group always give two different store keys (up to SHA-256
collisions): a key that happens to start with ``sha256:`` is hashed too, so a verbatim
key can never look like a digest.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterable

from msgpatterns.errors import ConfigurationError

__all__ = ["HASH_MARKER", "KeyBuilder", "KeyLike", "normalise_key"]

#: Prefix of a key stored as its digest.
HASH_MARKER = "sha256:"
_HASHED_LENGTH = len(HASH_MARKER) + 64

KeyLike = str | bytes | int | uuid.UUID


def normalise_key(key: object) -> str | bytes:
    """``key`` as text, or as bytes when it is bytes that are not UTF-8.

    Raises ``TypeError`` for a type that has no obvious text form, ``ValueError`` for
    a missing or empty key.
    """
    if type(key) is str and key:
        return key
    if key is None:
        raise ValueError("the idempotency key is None")
    if isinstance(key, bytes | bytearray | memoryview):
        raw = bytes(key)
        try:
            key = raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw
    elif isinstance(key, int | uuid.UUID) and not isinstance(key, bool):
        key = str(key)
    elif not isinstance(key, str):
        raise TypeError(f"an idempotency key must be str, bytes or int, not {type(key).__name__}")
    if not key:
        raise ValueError("the idempotency key is empty")
    return key


def _check_part(kind: str, value: str) -> None:
    if ":" in value:
        raise ConfigurationError(f"the idempotency {kind} cannot contain ':': {value!r}")


class KeyBuilder:
    """Builds store keys for one namespace, within a store limit of ``max_bytes``
    (UTF-8 bytes; None: no limit)."""

    __slots__ = ("_prefixes", "max_bytes", "namespace")

    def __init__(self, namespace: str, max_bytes: int | None) -> None:
        _check_part("namespace", namespace)
        if max_bytes is not None and max_bytes < len(namespace) + 2 + _HASHED_LENGTH:
            raise ConfigurationError(
                f"a store key limit of {max_bytes} bytes is too small for namespace "
                f"{namespace!r} and a SHA-256 key"
            )
        self.namespace = namespace
        self.max_bytes = max_bytes
        self._prefixes: dict[str, tuple[str, int]] = {}

    def _prefix(self, group: str) -> tuple[str, int]:
        found = self._prefixes.get(group)
        if found is None:
            _check_part("group", group)
            prefix = f"{self.namespace}:{group}:"
            size = len(prefix.encode("utf-8"))
            if self.max_bytes is not None and size + _HASHED_LENGTH > self.max_bytes:
                raise ConfigurationError(
                    f"namespace and group {prefix!r} leave no room for a key within "
                    f"{self.max_bytes} bytes"
                )
            found = (prefix, size)
            if len(self._prefixes) < 1024:
                self._prefixes[group] = found
        return found

    def build(self, key: object, group: str = "") -> str:
        """The store key of ``key`` in ``group``.

        Raises ``TypeError``/``ValueError`` for a key that is not usable (see
        :func:`normalise_key`), :class:`ConfigurationError` for a bad group.
        """
        prefix, size = self._prefix(group)
        return self._joined(prefix, size, key)

    def build_many(self, keys: Iterable[object], group: str = "") -> list[str]:
        """:meth:`build` for many keys of one group."""
        prefix, size = self._prefix(group)
        return [self._joined(prefix, size, key) for key in keys]

    def _joined(self, prefix: str, size: int, key: object) -> str:
        value = normalise_key(key)
        if isinstance(value, bytes):
            return prefix + HASH_MARKER + hashlib.sha256(value).hexdigest()
        if "\x00" not in value and not value.startswith(HASH_MARKER):
            try:
                encoded = value.encode("utf-8")
            except UnicodeEncodeError:
                pass  # lone surrogates: hash them below
            else:
                if self.max_bytes is None or size + len(encoded) <= self.max_bytes:
                    return prefix + value
                return prefix + HASH_MARKER + hashlib.sha256(encoded).hexdigest()
        digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
        return prefix + HASH_MARKER + digest
