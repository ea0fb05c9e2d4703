"""Stable key -> logic partition hashing and contiguous partition ranges.

A key always maps to the same logic partition, in every process and every run (CRC-32
of its bytes, not Python's salted ``hash``), so the number of logic partitions is the
only thing that must never change. Lanes (threads, consumers, physical partitions) own
contiguous ranges of logic partitions; changing the number of lanes moves ranges, never
keys between partitions.
"""

from __future__ import annotations

import zlib

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
    raise TypeError(f"an ordering key must be str, bytes or int, got {type(key).__name__}")


def logic_partition(key: Key, partitions: int) -> int:
    """The logic partition of ``key`` among ``partitions``: stable across processes."""
    if partitions < 1:
        raise ValueError("partitions must be at least 1")
    return zlib.crc32(key_bytes(key)) % partitions


def lane_ranges(lanes: int, partitions: int) -> list[range]:
    """Split ``range(partitions)`` into ``lanes`` contiguous, near-equal ranges."""
    if not 1 <= lanes <= partitions:
        raise ValueError(f"lanes must be between 1 and {partitions}, got {lanes}")
    bounds = [i * partitions // lanes for i in range(lanes + 1)]
    return [range(bounds[i], bounds[i + 1]) for i in range(lanes)]
