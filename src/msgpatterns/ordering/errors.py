"""Typed errors of the ordering helpers.

All of them are :class:`~msgpatterns.errors.Reject` subclasses: retrying cannot fix
them, so the consumer sends the message straight to the dead-letter store with the
reason, and keeps running.
"""

from __future__ import annotations

from msgpatterns.errors import MalformedMessage, Reject

__all__ = ["InvalidVersion", "MissingVersion", "VersionConflict"]


class InvalidVersion(MalformedMessage):
    """A message's version field is unusable (for example ``new`` is not after
    ``expected``)."""


class MissingVersion(InvalidVersion):
    """A message has no version (or timestamp) field, so it cannot be ordered."""


class VersionConflict(Reject):
    """The stored row can never accept this transition: it moved past ``expected``
    along another path (a writer outside the message flow changed the version)."""
