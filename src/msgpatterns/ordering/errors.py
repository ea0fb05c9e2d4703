"""Typed errors of the ordering helpers.

The message errors are :class:`~msgpatterns.errors.Reject` subclasses: retrying cannot fix
them, so the consumer sends the message straight to the dead-letter store with the
reason, and keeps running.
"""

from __future__ import annotations

from msgpatterns.errors import ConfigurationError, MalformedMessage, Reject

__all__ = [
    "InvalidVersion", "KeyStopped", "MissingVersion", "RouteConflict", "RouteError",
    "UnroutedMessage",
    "VersionConflict",
]


class InvalidVersion(MalformedMessage):
    """A message's version field is unusable (for example ``new`` is not after
    ``expected``)."""


class MissingVersion(InvalidVersion):
    """A message has no version (or timestamp) field, so it cannot be ordered."""


class UnroutedMessage(MalformedMessage):
    """A message in an ordered topic's partition carries no route version: it was not
    published with :meth:`OrderedTopic.publish`, so nothing says its partition is its
    key's, and its order cannot be kept. It is dead-lettered, never handled."""


class KeyStopped(Reject):
    """An earlier message of this key was dead-lettered and the ordered topic's consumer
    runs with ``on_dead_letter="stop"``: the later ones are dead-lettered too."""


class VersionConflict(Reject):
    """The stored row can never accept this transition: it moved past ``expected``
    along another path (a writer outside the message flow changed the version)."""


class RouteError(ConfigurationError):
    """A route change that breaks the ordered-topic rules (a partition that is not
    open, ranges that are not adjacent, a split point outside the range, a stored
    route that does not parse)."""


class RouteConflict(RouteError):
    """Another route change of the topic is in progress or won the race: one change at
    a time, versions contiguous. Read the routes again and decide anew."""
