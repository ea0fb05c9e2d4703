"""Batch publishing shared by the adapters: ``publish_many(topic, items)``.

An item is a message body (bytes, or what the adapter's ``publish`` accepts) or an
:class:`Outgoing` with a key and headers. ``publish_many`` returns the message ids in the
items' order, each the id ``publish`` would have returned. The broker round trips are
shared (one pipeline, one flush, confirms awaited together), so a batch costs about
one publish.

Failure: when a batch cannot be fully confirmed, the adapter raises
:class:`PartialPublish` (a :class:`~msgpatterns.errors.BrokerError`) whose ``ids`` says,
item by item, which messages the broker confirmed (their id) and which it did not
(None: not sent, or sent without a confirmation, so possibly delivered). Re-publishing
the None items completes the batch at least once. Each adapter documents whether a
failed batch can be partly written.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from msgpatterns.errors import ConfigurationError, PartialPublish

__all__ = ["Outgoing", "PartialPublish", "outgoing"]


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message of a batch: its body, business key and headers."""

    body: Any
    key: str | None = None
    headers: Mapping[str, str] | None = None


def outgoing(items: Iterable[Any]) -> list[Outgoing]:
    """The items as :class:`Outgoing` (a bare item is a body).
    :class:`~msgpatterns.errors.ConfigurationError` (a ``TypeError``) for a single
    ``str``/``bytes`` given instead of a sequence of them."""
    if isinstance(items, str | bytes | bytearray | memoryview):
        raise ConfigurationError("publish_many takes a sequence of bodies or Outgoing items, "
                        f"not one {type(items).__name__} (use publish for one message)")
    return [item if isinstance(item, Outgoing) else Outgoing(item) for item in items]


def failed(topic: str, ids: list[str | None], first: BaseException) -> PartialPublish:
    """The error for a batch of which only the non-None ``ids`` were confirmed."""
    done = sum(i is not None for i in ids)
    return PartialPublish(
        f"publish_many to {topic}: {done} of {len(ids)} messages confirmed; the first "
        f"failure: {first}", ids)
