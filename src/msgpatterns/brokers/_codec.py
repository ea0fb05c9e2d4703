"""Renamed :mod:`msgpatterns.brokers.codec` (integrations use it too); this module
re-exports it for code written against the old name."""

from __future__ import annotations

from msgpatterns.brokers.codec import *  # noqa: F403
from msgpatterns.brokers.codec import __all__ as __all__
