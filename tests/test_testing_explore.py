"""The schedule explorer finds what a once-in-order test cannot, shrinks it to the
shortest story, and passes correct handlers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from msgpatterns import MemoryChecker, Message, NeedRetry, Reject, idempotent
from msgpatterns.errors import ConfigurationError
from msgpatterns.testing import ScheduleFailure, explore_schedules

ORDERS = [("order-1", {"cents": 500}), ("order-2", {"cents": 700})]


def test_a_non_idempotent_handler_is_found_and_shrunk_to_one_lost_ack() -> None:
    charged: list[str] = []

    def charge(message: Message) -> None:
        charged.append(message.key or "")

    def each_order_charged_once(_: object) -> None:
        assert sorted(charged) == ["order-1", "order-2"], f"charged {charged}"

    with pytest.raises(ScheduleFailure) as failure:
        explore_schedules(charge, ORDERS, setup=charged.clear,
                          invariant=each_order_charged_once, seed=1)
    lines = str(failure.value).splitlines()
    assert lines[0].startswith("schedule (1 chaos step(s))")
    # The minimal story: one delivery whose ack is lost, then its redelivery.
    assert "the ack was lost" in lines[1]
    key = lines[1].split("key=")[1].split(" ")[0]
    assert any(f"key={key} (attempt 2): acked" in line for line in lines)
    assert any(line.startswith("invariant failed: charged") for line in lines)


def test_the_same_handler_under_idempotent_passes_every_schedule() -> None:
    charged: list[str] = []
    checkers: list[MemoryChecker] = []

    def fresh() -> None:
        charged.clear()
        checkers[:] = [MemoryChecker()]

    def charge(message: Message) -> None:
        @idempotent(checkers[0])
        def body(m: Message) -> None:
            charged.append(m.key or "")

        body(message)

    runs = explore_schedules(charge, ORDERS, setup=fresh, seed=2, max_examples=150,
                             invariant=lambda _: sorted(charged) == ["order-1", "order-2"])
    assert runs >= 150


def test_retries_and_dead_letters_are_part_of_the_story() -> None:
    seen: list[int] = []

    def flaky(message: Message) -> None:
        seen.append(message.attempt)
        if message.key == "bad":
            raise Reject("never valid")
        if message.attempt == 1:
            raise NeedRetry(reason="not yet")

    def never(_: object) -> None:
        raise AssertionError("show me the story")

    with pytest.raises(ScheduleFailure) as failure:
        explore_schedules(flaky, [("good", b""), ("bad", b"")], invariant=never,
                          setup=seen.clear, max_examples=5, seed=3)
    story = str(failure.value)
    assert "retry requested (not yet)" in story
    assert "dead-lettered (Reject: never valid)" in story


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"messages": []}, ConfigurationError),
     ({"messages": [object()]}, ConfigurationError),
     ({"max_examples": 0}, ConfigurationError)],
)
def test_misuse_is_refused(kwargs: dict[str, object], error: type[Exception]) -> None:
    options: dict[str, object] = {"messages": ORDERS, "invariant": lambda _: True}
    options.update(kwargs)
    with pytest.raises(error):
        explore_schedules(lambda m: None, **options)  # type: ignore[arg-type]


def test_an_async_handler_is_refused() -> None:
    async def handler(message: Message) -> None:
        return None

    with pytest.raises(TypeError, match="async def"):
        explore_schedules(handler, ORDERS, invariant=lambda _: True)


def test_an_idempotent_handler_built_once_serves_every_schedule() -> None:
    """Issue 23 item 8: the MemoryChecker of an @idempotent handler is reset before each
    schedule, so the handler need not be rebuilt by hand (before: the second schedule
    found every key DONE, skipped the body, and the invariant failed)."""
    charged: list[str] = []
    checker = MemoryChecker()

    @idempotent(checker)
    def charge(message: Message) -> None:
        charged.append(message.key or "")

    runs = explore_schedules(charge, ORDERS, setup=charged.clear, seed=2, max_examples=50,
                             invariant=lambda _: sorted(charged) == ["order-1", "order-2"])
    assert runs >= 50


def test_checkers_resets_a_memory_checker_the_handler_uses_inside() -> None:
    charged: list[str] = []
    checker = MemoryChecker()

    @idempotent(checker)
    def charge_once(m: Message) -> None:
        charged.append(m.key or "")

    def handler(message: Message) -> None:  # the guarded call is inside
        charge_once(message)

    explore_schedules(handler, ORDERS, setup=charged.clear, seed=3, max_examples=30,
                      checkers=[checker],
                      invariant=lambda _: sorted(charged) == ["order-1", "order-2"])
    with pytest.raises(ConfigurationError, match="MemoryCheckers"):
        explore_schedules(handler, ORDERS, invariant=lambda _: True,
                          checkers=[object()])  # type: ignore[list-item]


def test_reset_forgets_every_key_and_zeroes_the_stats() -> None:
    checker = MemoryChecker()
    ran: list[str] = []

    @idempotent(checker, key=lambda k: k)
    def once(k: str) -> None:
        ran.append(k)

    once("a")
    once("a")
    assert (len(checker), checker.stats.duplicates) == (1, 1)
    checker.reset()
    assert (len(checker), checker.stats.duplicates, checker.stats.completed) == (0, 0, 0)
    once("a")
    assert ran == ["a", "a"]


EXPLORE_IN_A_DIRECTORY = """
from msgpatterns.testing import ScheduleFailure, explore_schedules
seen = []
try:  # a failing invariant: Hypothesis would save the failing example
    explore_schedules(lambda m: seen.append(m.key), [("k", b"x")], setup=seen.clear,
                      invariant=lambda _: len(seen) < 2, max_examples=50, {extra})
except ScheduleFailure:
    pass
else:
    raise SystemExit("no failure found")
"""


EXPLORE_MANY = """
from msgpatterns.testing import explore_schedules
seen = []
explore_schedules(lambda m: seen.append(m.key), [("k", b"x"), ("j", b"y")],
                  setup=seen.clear, invariant=lambda _: True, max_examples=300)
"""


@pytest.mark.parametrize("script", [EXPLORE_MANY, EXPLORE_IN_A_DIRECTORY.format(extra="")],
                         ids=["passing", "failing"])
def test_hypothesis_writes_nothing_to_the_working_directory(tmp_path: Path,
                                                            script: str) -> None:
    """Before: Hypothesis' caches landed in ./.hypothesis of the user's project."""
    subprocess.run([sys.executable, "-c", script], cwd=tmp_path, check=True, timeout=120,
                   env=_env_with_src())
    assert list(tmp_path.iterdir()) == []


def test_database_keeps_hypothesis_files_where_asked(tmp_path: Path) -> None:
    extra = f"database={str(tmp_path / 'db')!r}"
    subprocess.run([sys.executable, "-c", EXPLORE_IN_A_DIRECTORY.format(extra=extra)],
                   cwd=tmp_path, check=True, timeout=120, env=_env_with_src())
    assert [p.name for p in tmp_path.iterdir()] == ["db"]
    assert any((tmp_path / "db" / "examples").iterdir())  # the failing schedule, kept


def _env_with_src() -> dict[str, str]:
    src = str(Path(__file__).parent.parent / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
