"""Settling the :class:`~msgpatterns.Message` items of a processed batch."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from msgpatterns._escape import escape_control
from msgpatterns.message import Message

__all__ = ["settle_messages"]

log = logging.getLogger("msgpatterns.batching")


def settle_messages(items: Iterable[object], error: BaseException | None) -> int:
    """Ack every :class:`Message` among ``items`` that is not settled yet.

    ``error`` None acks them as successes; otherwise they are acked with ``error`` so the
    consumer's retry policy redelivers (or dead-letters) them. Other items are ignored,
    as are messages the processor (or an ``on_error`` hook) already settled. An ack that
    raises is logged and never stops the others. Returns how many messages were settled.
    """
    settled = 0
    for item in items:
        if not isinstance(item, Message) or item.acked:
            continue
        try:
            if item.ack(error):
                settled += 1
        except BaseException:  # one failed ack must not strand the others
            log.exception("acking message %s after its batch failed", escape_control(item.id))
    return settled
