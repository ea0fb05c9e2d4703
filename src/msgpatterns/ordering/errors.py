"""Typed errors of the ordering helpers (defined in :mod:`msgpatterns.errors`, the home
of every error class, and re-exported here).

The message errors are :class:`~msgpatterns.errors.Reject` subclasses: retrying cannot fix
them, so the consumer sends the message straight to the dead-letter store with the
reason, and keeps running.
"""

from __future__ import annotations

from msgpatterns.errors import (
    InvalidVersion,
    KeyStopped,
    MissingVersion,
    RouteConflict,
    RouteError,
    UnroutedMessage,
    VersionConflict,
)

__all__ = [
    "InvalidVersion", "KeyStopped", "MissingVersion", "RouteConflict", "RouteError",
    "UnroutedMessage",
    "VersionConflict",
]
