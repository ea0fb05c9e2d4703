"""Test helpers for handlers built on msgpatterns.

The pytest plugin (registered through the ``pytest11`` entry point, so installing
msgpatterns is enough) provides fixtures; the assertion helpers work in any test.
"""

from msgpatterns.testing.assertions import (
    EffectLog,
    assert_all_acked,
    assert_dead_lettered,
    assert_no_dead_letters,
)

__all__ = ["EffectLog", "assert_all_acked", "assert_dead_lettered", "assert_no_dead_letters"]
