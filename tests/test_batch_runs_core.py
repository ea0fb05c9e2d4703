"""The sans-I/O batch-run procedure (msgpatterns.runtime.batches.run_batch) on its own.

Both drivers run a batch handler through it (the thread driver blocking on each
operation, the asyncio driver awaiting it), so the test is its driver: it answers
every operation and records what was asked, in order.
"""

from __future__ import annotations

import logging
from typing import Any, get_args

from msgpatterns import Message
from msgpatterns.errors import PartialFailure
from msgpatterns.idempotency import MemoryChecker, idempotent
from msgpatterns.idempotency.batch import guard_of
from msgpatterns.runtime.batches import run_batch
from msgpatterns.runtime.rounds import STOPPED, AckAll, ClaimRounds, Fail, Op, Prepare, drive

OPS = get_args(Op)
log = logging.getLogger("test.batches")


def _messages(count: int) -> list[Message]:
    return [Message(i, id=f"m{i}", key=f"k{i}") for i in range(count)]


def _drive(rounds: ClaimRounds | None, live: list[Message],
           answer: Any = None) -> tuple[Any, list[Op]]:
    """Run the procedure; ``answer`` is what the handler's call ends with."""
    seen: list[Op] = []
    guard = None if rounds is None else rounds.guard

    def perform(op: Op) -> Any:
        seen.append(op)
        name = type(op).__name__
        if name == "CallBatch":
            return answer
        if guard is not None and isinstance(op, Prepare):
            return guard.prepare(op.messages)
        if guard is not None and name == "Write":
            guard.finish(op.returned, op.raised)  # type: ignore[union-attr]
        return None

    outcome = drive(run_batch(rounds, live, start_scope=lambda _l, _m: None, log=log,
                              name="test"), dict.fromkeys(OPS, perform))
    return outcome, seen


def _names(ops: list[Op]) -> list[str]:
    return [type(op).__name__ for op in ops]


def _rounds(checker: MemoryChecker) -> ClaimRounds:
    guard = guard_of(idempotent(checker, group="g")(lambda messages: None), batch=True)
    assert guard is not None
    return ClaimRounds(guard, writer_runs_handlers=True)


def test_a_plain_batch_that_returned_is_acked_in_one_operation() -> None:
    live = _messages(3)
    outcome, ops = _drive(None, live)
    assert outcome is None
    assert _names(ops) == ["CallBatch", "AckAll"]
    assert isinstance(ops[1], AckAll) and ops[1].messages == live


def test_a_partial_failure_fails_only_the_messages_it_names() -> None:
    live = _messages(3)
    outcome, ops = _drive(None, live, PartialFailure({live[1]: ValueError("no")}))
    assert outcome is None
    assert _names(ops) == ["CallBatch", "Fail", "AckAll"]
    assert isinstance(ops[1], Fail) and ops[1].message is live[1]
    assert isinstance(ops[2], AckAll) and ops[2].messages == [live[0], live[2]]


def test_an_idempotent_batch_completes_its_claims_before_the_acks() -> None:
    checker = MemoryChecker()
    live = _messages(2)
    outcome, ops = _drive(_rounds(checker), live)
    assert outcome is None
    assert _names(ops) == ["Prepare", "Bind", "CallBatch", "Write", "AckAll"]
    assert checker.stats.completed == 2


def test_a_stop_cancelling_an_idempotent_batch_releases_its_claims() -> None:
    checker = MemoryChecker(lease=3600)
    live = _messages(2)
    outcome, ops = _drive(_rounds(checker), live, STOPPED)
    assert outcome is STOPPED
    assert _names(ops) == ["Prepare", "Bind", "CallBatch", "Write"]
    assert checker.stats.released == 2 and checker.stats.completed == 0  # keys free
