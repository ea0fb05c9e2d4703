"""Stable key -> logic partition hashing and contiguous partition ranges.

A key always maps to the same logic partition, in every process and every run (CRC-32
of its bytes, not Python's salted ``hash``), so the number of logic partitions is the
only thing that must never change. Lanes (threads, consumers, physical partitions) own
contiguous ranges of logic partitions; changing the number of lanes moves ranges, never
keys between partitions.
"""

from __future__ import annotations

import zlib

from msgpatterns.errors import ConfigurationError

__all__ = ["Key", "key_bytes", "lane_ranges", "logic_partition"]

#: What can be an ordering key: text, bytes or an integer (``42`` and ``"42"`` are the
#: same key).
Key = str | bytes | bytearray | memoryview | int


def key_bytes(key: Key) -> bytes:
    """The canonical bytes of ``key`` (UTF-8 for text, decimal digits for integers)."""
    if isinstance(key, str):
        return key.encode("utf-8")
    if isinstance(key, bytes | bytearray | memoryview):
        return bytes(key)
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key).encode("ascii")
    raise ConfigurationError(
        f"an ordering key must be str, bytes or int, got {type(key).__name__}")


def logic_partition(key: Key, partitions: int) -> int:
    """The logic partition of ``key`` among ``partitions``: stable across processes."""
    if partitions < 1:
        raise ConfigurationError(f"logic_partitions must be at least 1, got {partitions}")
    return zlib.crc32(key_bytes(key)) % partitions


def lane_ranges(lanes: int, partitions: int) -> list[range]:
    """Split ``range(partitions)`` into ``lanes`` contiguous, near-equal ranges.

    Raises :class:`~msgpatterns.errors.ConfigurationError` (a ``ValueError``) unless
    both are ints and ``1 <= lanes <= partitions``.
    """
    _require_count("logic_partitions", partitions)
    _require_count("lanes", lanes)
    if lanes > partitions:
        raise ConfigurationError(f"lanes must be between 1 and {partitions}, got {lanes}")
    bounds = [i * partitions // lanes for i in range(lanes + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(lanes)]


def _require_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name} must be an int of at least 1, got {value!r}")
