"""The settler: the one place an outcome becomes a decision, broker calls and counts.

A delivery's outcome (the handler returned, raised, acked with an error, hit its ack
deadline, or the consumer handed it back) goes in; :meth:`RetryPolicy.decide` turns it
into an action; the settler asks for the broker calls that carry it out and returns
what to count and what (a retry copy) takes the delivery's slot. Whatever fails on the
way - the retry policy, the broker call, the dead-letter record - the delivery is
settled another way (a fallback dead letter, or a nack), never left hanging.

The settler does no I/O itself ("sans I/O"): :meth:`Settler.settle` is a generator that
yields broker operations (:class:`AckOp`, :class:`NackOp`, :class:`DeadLetterOp`,
:class:`StoreOp`) and receives their failures. :func:`run_sync` performs them with a
thread broker; the asyncio driver awaits them with :func:`run_async`. So the thread and
the asyncio consumers share every settlement rule and differ only in how they wait.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from msgpatterns import headers as h
from msgpatterns._escape import escape_control
from msgpatterns.deadletter import DeadLetter, DeadLetterStore, format_traceback
from msgpatterns.delivery import Delivery, SettleCallback
from msgpatterns.errors import NeedRetry, describe, printable
from msgpatterns.message import Message
from msgpatterns.retry import Action, RetryPolicy, Verdict
from msgpatterns.runtime.lifecycle import Released
from msgpatterns.settlement import failure_headers

__all__ = [
    "AckOp",
    "DeadLetterOp",
    "NackOp",
    "Op",
    "Settled",
    "Settler",
    "StoreOp",
    "retry_copy",
    "run_async",
    "run_sync",
]

#: Delay of a fallback redelivery when the retry policy could not decide.
FALLBACK_DELAY = 1.0

R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class AckOp:
    """``broker.ack(message)``."""

    message: Message


@dataclass(frozen=True, slots=True)
class NackOp:
    """``broker.nack(message, delay)``."""

    message: Message
    delay: float


@dataclass(frozen=True, slots=True)
class DeadLetterOp:
    """``broker.dead_letter(message, record)``."""

    message: Message
    record: DeadLetter


@dataclass(frozen=True, slots=True)
class StoreOp:
    """``dead_letters.put(record)`` (the consumer's own dead-letter store)."""

    record: DeadLetter


Op = AckOp | NackOp | DeadLetterOp | StoreOp
#: A settlement in progress: yields operations, returns its result.
Steps = Generator[Op, None, R]


@dataclass(slots=True)
class Settled:
    """The result of a settlement: the :class:`ConsumerStats` fields to count, and the
    retry copy (if any) that takes the delivery's slot after ``delay`` seconds."""

    counted: list[str] = field(default_factory=list)
    retry: Message | None = None
    delay: float = 0.0


class Settler:
    """Settles deliveries for one consumer.

    Args:
        policy: the consumer's :class:`RetryPolicy`.
        now: the broker's clock (failure times, dead-letter records).
        group: the consumer group (dead-letter records, logs).
        name: the consumer's name (logs).
        handler_name: the handler's name (logs).
        own_store: dead letters go to the consumer's store (then the delivery is
            acked) instead of ``broker.dead_letter``.
        keep_redeliveries: ordered mode: a redelivery stays in the process as a retry
            copy that keeps its key (a broker redelivery would let later messages of
            the key overtake it).
        rebind: where retry copies report their outcome (the driver's settling).
        log: the driver's logger.
    """

    def __init__(self, *, policy: RetryPolicy, now: Callable[[], float], group: str,
                 name: str, handler_name: str, own_store: bool, keep_redeliveries: bool,
                 rebind: SettleCallback | None, log: logging.Logger) -> None:
        self.policy = policy
        self.now = now
        self.group = group
        self.name = name
        self.handler_name = handler_name
        self.own_store = own_store
        self.keep_redeliveries = keep_redeliveries
        self.rebind = rebind
        self.log = log

    def extra(self, message: Message) -> dict[str, Any]:
        """The ``extra`` fields of every log line about ``message``."""
        return {"message_id": message.id, "topic": message.topic, "group": self.group,
                "attempt": message.attempt}

    # -- the settlement ------------------------------------------------------------

    def settle(self, message: Message, error: BaseException | None) -> Steps[Settled]:
        """Settle ``message`` whose outcome is ``error`` (None: success)."""
        counted: list[str] = []
        retry: Message | None = None
        delay = 0.0
        action: Action | None = None
        try:
            if isinstance(error, Released):
                counted.append("released")
                yield NackOp(message, 0.0)
                return Settled(counted)
            verdict = self.decide(message, error)
            action = verdict.action
            if action is Action.ACK:
                yield AckOp(message)
                counted.append("acked")
                return Settled(counted)
            assert error is not None
            counted.append("failed")
            self._log_failure(message, error, action, verdict.delay)
            delay = verdict.delay
            if action is Action.RETRY_LOCALLY:
                retry = retry_copy(message, local=True)
                counted.append("retried_locally")
            elif action is Action.REDELIVER:
                # The failure history travels in the headers (it survives redelivery).
                message.headers = failure_headers(message.headers, error, self.now())
                if self.keep_redeliveries:
                    retry = retry_copy(message, attempt=message.attempt + 1)
                    retry.headers[h.ATTEMPT] = str(retry.attempt)
                else:
                    yield NackOp(message, delay)
                counted.append("redelivered")
            else:
                record = DeadLetter.from_error(message, error, now=self.now(),
                                               reason=verdict.reason, group=self.group)
                self.log.error(
                    "%s: message %s (key %r, topic %r) dead-lettered after %d attempt(s): %s",
                    self.name, escape_control(message.id), message.key, message.topic,
                    message.attempt, escape_control(verdict.reason), extra=self.extra(message),
                )
                yield from self._put_dead_letter(message, record)
                counted.append("dead_lettered")
        except Exception as failure:
            counted.append("broker_errors")
            retry = None
            if not isinstance(error, Released):
                outcome = yield from self._settle_otherwise(message, error, action, failure)
                if outcome is not None:
                    counted.append(outcome)
        if retry is not None:
            retry.delivery.bind(self.rebind)
        return Settled(counted, retry, delay)

    def ack_failed(self, message: Message, failure: Exception) -> Steps[Settled]:
        """The ack of a success raised ``failure``: settle it another way."""
        counted = ["broker_errors"]
        outcome = yield from self._settle_otherwise(message, None, Action.ACK, failure)
        if outcome is not None:
            counted.append(outcome)
        return Settled(counted)

    def hand_back(self, messages: Sequence[Message]) -> Steps[int]:
        """Nack ``messages`` unprocessed (the consumer stops); returns how many failed."""
        errors = 0
        for message in messages:
            try:
                yield NackOp(message, 0.0)
            except Exception:
                errors += 1
                self.log.exception("%s: handing message %s back failed", self.name,
                                   escape_control(message.id), extra=self.extra(message))
        return errors

    def decide(self, message: Message, error: BaseException | None) -> Verdict:
        """The retry policy's verdict; when the policy itself fails, a safe one: an ack
        for a success, a dead letter once ``max_attempts`` is reached, else a
        redelivery after a short delay."""
        try:
            return self.policy.decide(message, error)
        except Exception:
            self.log.exception("%s: the retry policy failed on message %s", self.name,
                               escape_control(message.id), extra=self.extra(message))
        if error is None:
            return Verdict(Action.ACK)
        kind = type(error).__name__
        if message.attempt >= self.policy.max_attempts:
            return Verdict(Action.DEAD_LETTER, reason=f"gave up after "
                           f"{message.attempt} attempts: {kind} (retry policy failed)")
        return Verdict(Action.REDELIVER, FALLBACK_DELAY)

    # -- helpers ---------------------------------------------------------------------

    def _put_dead_letter(self, message: Message, record: DeadLetter) -> Steps[None]:
        if self.own_store:
            yield StoreOp(record)
            yield AckOp(message)
        else:
            yield DeadLetterOp(message, record)

    def _settle_otherwise(self, message: Message, error: BaseException | None,
                          action: Action | None, failure: Exception) -> Steps[str | None]:
        """The settlement of ``message`` raised ``failure``: settle it another way so
        the delivery never hangs - a dead letter with a minimal, always-encodable record
        when a dead letter was due, else a nack for redelivery (the durable attempt
        count then moves on towards ``max_attempts``). Returns the stat to count, or
        None when the broker refused every way (it redelivers at its own timeout)."""
        self.log.error("%s: settling message %s failed (%s); settling it another way",
                       self.name, escape_control(message.id), escape_control(describe(failure)),
                       extra=self.extra(message))
        if action is Action.DEAD_LETTER or (
                action is None and message.attempt >= self.policy.max_attempts):
            try:
                yield from self._put_dead_letter(
                    message, self._fallback_record(message, error, failure))
                return "dead_lettered"
            except Exception:
                self.log.exception("%s: fallback dead letter of %s failed", self.name,
                                   escape_control(message.id), extra=self.extra(message))
        try:
            yield NackOp(message, 0.0)
            return "redelivered"
        except Exception:
            self.log.exception(
                "%s: message %s could not be settled; the broker redelivers it after its "
                "own timeout", self.name, escape_control(message.id), extra=self.extra(message),
            )
            return None

    def _fallback_record(self, message: Message, error: BaseException | None,
                         failure: Exception) -> DeadLetter:
        now = self.now()
        kind = type(error) if error is not None else type(failure)
        return DeadLetter(
            message=message,
            error_type=printable(f"{kind.__module__}.{kind.__qualname__}"),
            error_message=describe(error),
            traceback=format_traceback(error) if error is not None else "",
            attempts=message.attempt,
            first_failed_at=now,
            last_failed_at=now,
            reason=printable(f"dead-lettered after a failed settlement: {describe(failure)}"),
            group=self.group,
        )

    def _log_failure(self, message: Message, error: BaseException, action: Action,
                     delay: float) -> None:
        if isinstance(error, NeedRetry):
            self.log.debug("%s: message %s asked for a retry (%s)", self.name,
                           escape_control(message.id), escape_control(describe(error)),
                           extra=self.extra(message))
        elif action is not Action.DEAD_LETTER:
            self.log.warning(
                "%s: handler %s failed on message %s (attempt %d): %s: %s; %s in %.3gs",
                self.name, self.handler_name, escape_control(message.id), message.attempt,
                type(error).__name__, escape_control(describe(error)), action.value, delay,
                extra=self.extra(message),
            )


def retry_copy(message: Message, *, attempt: int | None = None,
               local: bool = False) -> Message:
    """A fresh, unsettled copy of ``message`` for another attempt: the same value and
    receipt, a new delivery (settle-once state). ``local=True``: an in-process retry
    (``local_retries + 1``); otherwise a new ``attempt`` kept by the runtime, with
    ``local_retries`` back at 0."""
    clone = Message(
        message.raw_body,
        id=message.id,
        key=message.key,
        topic=message.topic,
        headers=message.headers,
        timestamp=message.timestamp,
        attempt=message.attempt if attempt is None else attempt,
        partition=message.partition,
        offset=message.offset,
        delivery=Delivery(message.receipt),
    )
    clone.local_retries = message.local_retries + 1 if local else 0
    return clone


def run_sync(steps: Steps[R], broker: Any, store: DeadLetterStore | None) -> R:
    """Carry out ``steps`` with a thread broker: each operation's failure is thrown
    back into the settlement, which settles another way."""
    try:
        op = next(steps)
        while True:
            op = _advance(steps, _perform_sync(op, broker, store))
    except StopIteration as done:
        result: R = done.value
        return result


async def run_async(steps: Steps[R], broker: Any, store: DeadLetterStore | None) -> R:
    """:func:`run_sync` for an asyncio broker (the store's ``put`` runs in a thread)."""
    try:
        op = next(steps)
        while True:
            op = _advance(steps, await _perform_async(op, broker, store))
    except StopIteration as done:
        result: R = done.value
        return result


def _advance(steps: Steps[R], failure: Exception | None) -> Op:
    """The next operation, after the last one succeeded or raised ``failure``."""
    return steps.send(None) if failure is None else steps.throw(failure)


def _perform_sync(op: Op, broker: Any, store: DeadLetterStore | None) -> Exception | None:
    """Perform ``op``; returns its failure instead of raising it."""
    try:
        if isinstance(op, AckOp):
            broker.ack(op.message)
        elif isinstance(op, NackOp):
            broker.nack(op.message, op.delay)
        elif isinstance(op, DeadLetterOp):
            broker.dead_letter(op.message, op.record)
        else:
            assert store is not None
            store.put(op.record)
    except Exception as exc:
        return exc
    return None


async def _perform_async(op: Op, broker: Any,
                         store: DeadLetterStore | None) -> Exception | None:
    """Perform ``op`` on an asyncio broker; returns its failure instead of raising it."""
    try:
        if isinstance(op, AckOp):
            await broker.ack(op.message)
        elif isinstance(op, NackOp):
            await broker.nack(op.message, op.delay)
        elif isinstance(op, DeadLetterOp):
            await broker.dead_letter(op.message, op.record)
        else:
            assert store is not None
            await asyncio.to_thread(store.put, op.record)
    except Exception as exc:
        return exc
    return None
