"""Explore delivery schedules against a handler and shrink a failure to a short story.

Unit tests of a handler usually deliver each message once, in order. Brokers do not:
they deliver twice, late, out of order, and lose acks so that a message the handler
finished comes back. :func:`explore_schedules` asks Hypothesis for schedules of those
events, runs the user's handler through each one against the user's own state, checks
the user's invariant, and when it breaks, shrinks the schedule to a minimal one and
reports it as a story::

    schedule (3 steps), then every unsettled message delivered until settled:
      1. deliver m0 key='order-1' (attempt 1): handler returned; the ack was lost
      2. deliver m0 key='order-1' (attempt 2): handler returned; acked
    invariant failed: order-1 charged 2 times

A schedule is a *chaos prefix* of steps (which message, and whether its ack is lost),
then a drain: every message not yet settled is delivered, in publish order, until it
is acked or dead-lettered. So every message is delivered at least once and the
invariant is checked on a finished run, as the broker would leave it.

Guarantees: each schedule starts from ``setup()``, with every ``MemoryChecker`` of an
``@idempotent`` handler (and those in ``checkers``) reset, so the same guarded handler
serves every schedule; a failure is reported with the smallest schedule Hypothesis
finds; runs are reproducible with ``seed``. Hypothesis writes nothing to the working
directory (its caches go to a temporary directory, removed afterwards) unless
``database=`` names a directory for its example database.
"""

from __future__ import annotations

import contextlib
import enum
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from msgpatterns._callables import require_sync_callable
from msgpatterns._extras import require
from msgpatterns.errors import ConfigurationError, NeedRetry, Reject, ScheduleFailure, describe
from msgpatterns.idempotency.batch import guard_of
from msgpatterns.idempotency.memory import MemoryChecker
from msgpatterns.message import Message

__all__ = ["Fault", "ScheduleFailure", "explore_schedules"]


class Fault(enum.Enum):
    """What goes wrong around one delivery of the chaos prefix."""

    NONE = "none"
    #: The handler ran to the end, then the ack never reached the broker (a crash
    #: after the handler, a dropped connection): the message comes back.
    ACK_LOST = "ack-lost"


@dataclass
class _Run:
    """One schedule's execution: what was delivered, what is settled, the story."""

    messages: Sequence[Message]
    handler: Callable[[Message], Any]
    state: Any
    max_attempts: int
    attempts: dict[int, int] = field(default_factory=dict)
    settled: set[int] = field(default_factory=set)
    story: list[str] = field(default_factory=list)

    def deliver(self, index: int, fault: Fault) -> None:
        original = self.messages[index]
        attempt = self.attempts.get(index, 0) + 1
        self.attempts[index] = attempt
        message = Message(
            original.raw_body, id=original.id, key=original.key, topic=original.topic,
            headers=original.headers, timestamp=original.timestamp, attempt=attempt,
            partition=original.partition, offset=original.offset,
        )
        label = f"deliver m{index} key={original.key!r} (attempt {attempt})"
        outcome = self._run_handler(message)
        if outcome == "acked" and fault is Fault.ACK_LOST:
            self.story.append(f"{label}: handler returned; the ack was lost")
            return
        if outcome == "acked" or outcome.startswith("dead-lettered"):
            self.settled.add(index)
        self.story.append(f"{label}: {outcome}")

    def _run_handler(self, message: Message) -> str:
        try:
            self.handler(message)
        except Reject as exc:
            return f"dead-lettered ({type(exc).__name__}: {describe(exc)})"
        except NeedRetry as exc:
            return f"retry requested ({describe(exc)})"
        except Exception as exc:
            if message.attempt >= self.max_attempts:
                return f"dead-lettered after {message.attempt} attempts ({exc!r})"
            return f"failed ({type(exc).__name__}: {describe(exc)}); redelivered later"
        if message.auto_ack or message.succeeded:
            return "acked"
        if message.acked:
            return f"failed by its own ack ({message.ack_error!r}); redelivered later"
        return "never acked (the ack deadline will redeliver it)"

    def drain(self) -> None:
        for _ in range(self.max_attempts):
            pending = [i for i in range(len(self.messages)) if i not in self.settled]
            if not pending:
                return
            for index in pending:
                self.deliver(index, Fault.NONE)

    def render(self, prefix_steps: int) -> str:
        lines = [f"schedule ({prefix_steps} chaos step(s)), then every unsettled message "
                 "delivered until settled:"]
        lines += [f"  {n}. {step}" for n, step in enumerate(self.story, 1)]
        return "\n".join(lines)


def _as_message(item: Message | Mapping[str, Any] | tuple[Any, Any], index: int) -> Message:
    if isinstance(item, Message):
        return item
    if isinstance(item, tuple) and len(item) == 2:
        key, body = item
        return Message(body, id=f"m{index}", key=key)
    if isinstance(item, Mapping):
        return Message(item["body"], id=item.get("id", f"m{index}"), key=item.get("key"),
                       headers=item.get("headers"), topic=item.get("topic", ""))
    raise ConfigurationError(
        f"messages[{index}] must be a Message, a (key, body) pair or a mapping with a "
        f"'body', got {item!r}"
    )


@contextlib.contextmanager
def _hypothesis_home(database: str | os.PathLike[str] | None) -> Iterator[Path | None]:
    """Hypothesis' storage directory for one exploration: ``database`` when given,
    else a temporary directory removed afterwards (never ``./.hypothesis``)."""
    from hypothesis import configuration

    previous = getattr(configuration, "__hypothesis_home_directory", None)
    with contextlib.ExitStack() as stack:
        home = Path(database) if database is not None else Path(
            stack.enter_context(tempfile.TemporaryDirectory(prefix="msgpatterns-explore-")))
        configuration.set_hypothesis_home_dir(home)
        try:
            yield home if database is not None else None
        finally:
            configuration.set_hypothesis_home_dir(previous)


def _memory_checkers(handler: Callable[..., Any],
                     extra: Sequence[MemoryChecker]) -> list[MemoryChecker]:
    found = list(extra)
    guard = guard_of(handler)
    if guard is not None and isinstance(guard.checker, MemoryChecker):
        found.append(guard.checker)
    for checker in found:
        if not isinstance(checker, MemoryChecker):
            raise ConfigurationError(
                f"checkers= takes MemoryCheckers (reset before each schedule), got "
                f"{type(checker).__name__}; reset other stores in setup=")
    return list({id(c): c for c in found}.values())


def explore_schedules(
    handler: Callable[[Message], Any],
    messages: Sequence[Message | Mapping[str, Any] | tuple[Any, Any]],
    *,
    invariant: Callable[[Any], Any],
    setup: Callable[[], Any] | None = None,
    teardown: Callable[[Any], Any] | None = None,
    max_examples: int = 200,
    max_steps: int = 12,
    max_attempts: int = 5,
    lost_acks: bool = True,
    seed: int | None = None,
    checkers: Sequence[MemoryChecker] = (),
    database: str | os.PathLike[str] | None = None,
) -> int:
    """Run ``handler`` over generated delivery schedules of ``messages``.

    Args:
        handler: ``handler(message)``, as given to a Consumer (return to ack; raise
            ``NeedRetry`` or an error to be redelivered; ``Reject`` to dead-letter).
        messages: what the broker holds: Messages, ``(key, body)`` pairs, or mappings
            with ``body`` and optional ``key``, ``id``, ``headers``, ``topic``.
        invariant: ``invariant(state)`` raises ``AssertionError`` (or returns False)
            when the state after a finished run is wrong.
        setup: returns a fresh state before each schedule (and resets your stores);
            the handler reads it however it likes (a closure, a global, a database).
        teardown: ``teardown(state)`` after each schedule.
        max_examples: schedules to try.
        max_steps: longest chaos prefix (duplicates, reordering, lost acks).
        max_attempts: deliveries after which a failing message counts as dead-lettered.
        lost_acks: include lost acks among the faults.
        seed: make the exploration reproducible.
        checkers: more ``MemoryChecker`` s to reset before each schedule (the one of
            an ``@idempotent`` handler is found and reset without it; reset other
            stores - Redis, SQL - in ``setup``).
        database: a directory for Hypothesis' example database (failing schedules
            are replayed first on the next run) and caches; None (default): a
            temporary directory, removed afterwards, and no example database.

    Returns the number of schedules run. Raises :class:`ScheduleFailure` with the
    minimal failing schedule as a story.
    """
    hypothesis = require("hypothesis", "testing")
    st = require("hypothesis.strategies", "testing")
    require_sync_callable(handler, what="handler", where="explore_schedules")
    require_sync_callable(invariant, what="invariant", where="explore_schedules")
    if not messages:
        raise ConfigurationError("explore_schedules needs at least one message")
    if max_examples < 1 or max_steps < 0 or max_attempts < 1:
        raise ConfigurationError("max_examples and max_attempts must be >= 1, max_steps >= 0")
    originals = [_as_message(item, i) for i, item in enumerate(messages)]
    faults = [Fault.NONE, Fault.ACK_LOST] if lost_acks else [Fault.NONE]
    step = st.tuples(st.integers(0, len(originals) - 1), st.sampled_from(faults))
    runs = 0
    fresh = _memory_checkers(handler, checkers)

    def one_schedule(prefix: list[tuple[int, Fault]]) -> None:
        nonlocal runs
        runs += 1
        for checker in fresh:
            checker.reset()
        state = setup() if setup is not None else None
        run = _Run(originals, handler, state, max_attempts)
        try:
            for index, fault in prefix:
                run.deliver(index, fault)
            run.drain()
            try:
                verdict = invariant(state)
            except AssertionError as exc:
                raise ScheduleFailure(
                    f"{run.render(len(prefix))}\ninvariant failed: {describe(exc)}"
                ) from exc
            if verdict is False:
                raise ScheduleFailure(f"{run.render(len(prefix))}\ninvariant returned False")
        finally:
            if teardown is not None:
                teardown(state)

    with _hypothesis_home(database) as home:
        phases = [hypothesis.Phase.generate, hypothesis.Phase.shrink]
        examples = None
        if home is not None:
            examples = hypothesis.database.DirectoryBasedExampleDatabase(home / "examples")
            phases.insert(0, hypothesis.Phase.reuse)
        settings = hypothesis.settings(
            max_examples=max_examples, deadline=None, database=examples,
            derandomize=seed is not None,
            suppress_health_check=list(hypothesis.HealthCheck), phases=phases,
        )
        test = hypothesis.given(st.lists(step, max_size=max_steps))(one_schedule)
        if seed is not None:
            test = hypothesis.seed(seed)(test)
        settings(test)()
    return runs
