"""Test helpers for handlers built on msgpatterns.

The pytest plugin (registered through the ``pytest11`` entry point, so installing
msgpatterns is enough) provides fixtures; the assertion helpers work in any test.
"""

from typing import TYPE_CHECKING

from msgpatterns.testing.assertions import (
    EffectLog,
    assert_all_acked,
    assert_dead_lettered,
    assert_no_dead_letters,
)
from msgpatterns.testing.raw import FakeKafkaConsumer, FakeKafkaRecord, FakePikaChannel

if TYPE_CHECKING:
    from msgpatterns.testing.explore import Fault, ScheduleFailure, explore_schedules

__all__ = [
    "EffectLog",
    "FakeKafkaConsumer",
    "FakeKafkaRecord",
    "FakePikaChannel",
    "Fault",
    "ScheduleFailure",
    "assert_all_acked",
    "assert_dead_lettered",
    "assert_no_dead_letters",
    "explore_schedules",
]


def __getattr__(name: str) -> object:
    # The schedule explorer needs Hypothesis: import it only when asked for.
    if name in ("explore_schedules", "ScheduleFailure", "Fault"):
        from msgpatterns.testing import explore

        return getattr(explore, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
