"""Test helpers for handlers built on msgpatterns.

The pytest plugin (registered through the ``pytest11`` entry point, so installing
msgpatterns is enough) provides fixtures; the assertion helpers work in any test.
"""

from typing import TYPE_CHECKING

from msgpatterns._extras import lazy_attributes
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


# The schedule explorer needs Hypothesis: import it only when asked for.
__getattr__ = lazy_attributes(__name__, {
    "explore_schedules": "msgpatterns.testing.explore",
    "ScheduleFailure": "msgpatterns.testing.explore",
    "Fault": "msgpatterns.testing.explore",
})
