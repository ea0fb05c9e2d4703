"""Batch handlers (``batch=True``): what one call of the handler did to each of its
messages, and which idempotency claims that finishes - the rules both drivers follow
(sans I/O: the thread driver :class:`msgpatterns.Consumer` and the asyncio driver
:class:`msgpatterns.aio.AsyncConsumer` carry the answers out, blocking or awaiting).

One call, per message of the list it received:

* the handler returned and the message is under auto ack: a success (acked, its claim
  completed - DONE before the ack);
* the handler raised, or named the message in a
  :class:`~msgpatterns.errors.PartialFailure`: a failure with that error, through the
  retry policy on its own (its claim released);
* the handler disabled auto ack for it: it waits for its explicit ``message.ack()``
  (its claim is finished then, or now if that came during the call).

A message settled while the call ran (its own ``ack``/``ack(error)``, its ack deadline,
a stop) keeps that first settlement: settle-once ignores the later one. Its claim
still follows the call: a handler that returned has its effect recorded.

One batch run (:func:`run_batch`) is a procedure of the claim rounds' kind
(:mod:`msgpatterns.runtime.rounds`): a generator that yields the operations it needs
(the claim round trip, :class:`~msgpatterns.runtime.rounds.CallBatch`, the claims'
writes, the settlements) and receives their answers. The thread driver
(:mod:`msgpatterns.runtime.thread_batches`) performs them blocking, the asyncio driver
(:mod:`msgpatterns.runtime.async_batches`) awaits them: every decision is made here,
once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from msgpatterns.errors import PartialFailure
from msgpatterns.idempotency.batch import Entry
from msgpatterns.message import Message
from msgpatterns.observability import stats as _obs
from msgpatterns.observability.stats import DeliveryScope
from msgpatterns.runtime.rounds import (
    STOPPED,
    AckAll,
    CallBatch,
    ClaimRounds,
    Fail,
    StartScope,
    Steps,
)

__all__ = ["BatchOutcome", "judge_batch", "run_batch"]


class BatchOutcome:
    """The messages of one batch-handler call, by what happens to them next."""

    __slots__ = ("errors", "explicit", "raised", "returned")

    def __init__(self, returned: list[Message], raised: list[tuple[Message, BaseException]],
                 explicit: list[Message], errors: list[BaseException | None] | None) -> None:
        #: Successes to ack (their claims completed first).
        self.returned = returned
        #: Failures, each with its own error, to settle one by one.
        self.raised = raised
        #: Awaiting their explicit ack (the handler disabled auto ack).
        self.explicit = explicit
        #: Each message's outcome for telemetry, in the order of the call's list
        #: (None: every message returned).
        self.errors = errors

    def error_of(self, index: int) -> BaseException | None:
        """The outcome of the call's ``index``-th message (None: it returned)."""
        return None if self.errors is None else self.errors[index]


def judge_batch(live: Sequence[Message], error: BaseException | None, *,
                log: logging.Logger, name: str) -> BatchOutcome:
    """Sort the messages of one call of a batch handler on ``live`` that raised
    ``error`` (None: returned). A :class:`PartialFailure` fails only the messages it
    names (a name that is not in the batch is logged and ignored); any other error
    fails every message."""
    failures: Mapping[Message, BaseException] = {}
    if isinstance(error, PartialFailure):
        failures, error = error.failures, None
        members = set(live)
        strangers = [m for m in failures if m not in members]
        if strangers:
            log.warning("%s: PartialFailure names %d message(s) that are not in the batch "
                        "(ignored), e.g. %r", name, len(strangers), strangers[0])
    if error is None and not failures:  # the common case: every message returned
        returned = [m for m in live if m.delivery.auto_ack]
        explicit = [m for m in live if not m.delivery.auto_ack] \
            if len(returned) < len(live) else []
        return BatchOutcome(returned, [], explicit, None)
    returned, explicit = [], []
    raised: list[tuple[Message, BaseException]] = []
    errors: list[BaseException | None] = []
    for message in live:
        failed = failures.get(message, error)
        errors.append(failed)
        if failed is not None:
            raised.append((message, failed))
        elif message.delivery.auto_ack:
            returned.append(message)
        else:
            explicit.append(message)
    return BatchOutcome(returned, raised, explicit, errors)


def run_batch(rounds: ClaimRounds | None, live: list[Message], *, start_scope: StartScope,
              log: logging.Logger, name: str) -> Steps[Any]:
    """One run of a batch handler on ``live`` (their deadlines started, their bodies
    decoded): when it is ``@idempotent`` (``rounds``), one claim round trip first -
    the handler receives only the claimed messages - then one :class:`CallBatch`,
    then each message settled on its own (:func:`judge_batch`; the claims finished
    first: DONE before ack). The repeats of keys the batch held run next, as a batch
    of their own (duplicates now, or run if the first copy failed). Returns
    :data:`~msgpatterns.runtime.rounds.STOPPED` when the stop cancelled the handler
    (its claims released)."""
    while True:
        entries: dict[Message, Entry] = {}
        later: list[Message] = []
        if rounds is not None and live:
            runs, later = yield from rounds.prepared(live)
            entries = {entry.message: entry for entry in runs}
            live = yield from rounds.begin_all(runs)
        if live:
            listener = _obs.listener
            scopes = None if listener is None else [start_scope(listener, m) for m in live]
            error = yield CallBatch(list(live))
            if error is STOPPED:  # the stop cancelled it: its messages were handed back
                _close(scopes)
                if rounds is not None:
                    yield from rounds.batch_stopped(entries)
                return STOPPED
            if error is None and rounds is None and scopes is None:
                # The common case: every message returned; those the handler settled
                # or acks itself are left alone (AckAll leaves them alone).
                yield AckAll(live)
                return None
            outcome = judge_batch(live, error, log=log, name=name)
            try:
                if scopes is not None:
                    for index, scope in enumerate(scopes):
                        if scope is not None:
                            _obs.report(scope.handler_returned, outcome.error_of(index))
                if rounds is not None:  # claims finished first: DONE before ack
                    yield from rounds.batch_ran(entries, outcome.returned, outcome.raised,
                                                outcome.explicit)
                else:
                    for message, failed_with in outcome.raised:
                        yield Fail(message, failed_with)
                    yield AckAll(outcome.returned)
            finally:
                _close(scopes)
        if not later:
            return None
        live = [m for m in later if not m.acked]  # repeats of keys this batch held


def _close(scopes: list[DeliveryScope | None] | None) -> None:
    if scopes is not None:
        for scope in reversed(scopes):
            if scope is not None:
                _obs.report(scope.close)
