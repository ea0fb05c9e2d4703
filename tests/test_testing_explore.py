"""The schedule explorer finds what a once-in-order test cannot, shrinks it to the
shortest story, and passes correct handlers."""

from __future__ import annotations

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
