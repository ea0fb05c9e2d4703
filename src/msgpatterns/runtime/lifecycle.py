"""The lifecycle both drivers share: states, and the hand-back marker of a stop."""

from __future__ import annotations

import enum

__all__ = ["Released", "State"]


class State(enum.Enum):
    """NEW -> RUNNING -> STOPPING -> STOPPED (a stopped consumer may start again)."""

    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"


class Released(Exception):
    """Internal outcome: the consumer is stopping and hands the message back
    unprocessed (a nack for immediate redelivery; not a failure)."""
