"""What the ``@pytest.mark.msgpatterns(...)`` marker asks of the fake brokers (the sync
and the async fixture both read it)."""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["MARKER_OPTIONS", "fake_broker_options"]

#: Options the ``msgpatterns`` marker passes to the ``fake_broker`` fixture.
MARKER_OPTIONS = ("seed", "duplicate_rate", "reorder_window", "lost_ack_rate",
                  "visibility_timeout")


def fake_broker_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The fake broker's options from the closest ``@pytest.mark.msgpatterns(...)``."""
    options: dict[str, Any] = {"seed": 0}
    marker = request.node.get_closest_marker("msgpatterns")
    if marker is not None:
        if marker.args:
            raise pytest.UsageError("@pytest.mark.msgpatterns takes keyword arguments only")
        unknown = set(marker.kwargs) - set(MARKER_OPTIONS)
        if unknown:
            raise pytest.UsageError(
                f"@pytest.mark.msgpatterns: unknown option(s) {sorted(unknown)}; "
                f"known: {', '.join(MARKER_OPTIONS)}"
            )
        options.update(marker.kwargs)
    return options
