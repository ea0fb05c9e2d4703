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
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from msgpatterns.errors import PartialFailure
from msgpatterns.idempotency.batch import BatchGuard, Entry
from msgpatterns.message import Message
from msgpatterns.runtime.rounds import expired

__all__ = ["BatchOutcome", "Prepared", "begin_all", "judge_batch", "sort_prepared"]


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

    def claims(self, entries: Mapping[Message, Entry]) -> tuple[list[Entry], list[Entry],
                                                                   list[Entry]]:
        """The claims of ``entries`` (message -> its claimed entry) this call finishes:
        to complete (returned: the handler's effect is recorded even when the
        message's ack deadline or a stop settled it meanwhile), to release (raised, or
        failed by the handler's own ``message.ack(error)``), and those of the messages
        awaiting their explicit ack (finished when acked - or now, see
        :meth:`BatchGuard.end <msgpatterns.idempotency.batch.BatchGuard.end>`)."""
        done: list[Entry] = []
        failed = [entries[m] for m, _ in self.raised if m in entries]
        for message in self.returned:
            entry = entries.get(message)
            if entry is None:
                continue
            error = message.delivery.error
            if error is not None and not expired(error):
                # It acked itself with an error during the call: a failure. (Its
                # settlement released the claim already where that runs inline; on the
                # asyncio driver it may still be on its way.)
                failed.append(entry)
            else:
                done.append(entry)
        explicit = [entries[m] for m in self.explicit if m in entries]
        return done, failed, explicit


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


class Prepared:
    """One batch claim's entries, sorted: those whose handler runs (``runs``), those to
    settle without running it (``unrun``: a duplicate as a success, a key in progress,
    a missing key... with their error), and those to prepare again once the claims of
    ``runs`` are finished (``later``: their key is held by an earlier message of the
    same batch)."""

    __slots__ = ("later", "runs", "unrun")

    def __init__(self) -> None:
        self.runs: list[Entry] = []
        self.unrun: list[Entry] = []
        self.later: list[Message] = []


def sort_prepared(entries: Sequence[Entry]) -> Prepared:
    """Sort the entries :meth:`BatchGuard.prepare` returned."""
    prepared = Prepared()
    for entry in entries:
        if entry.later:
            prepared.later.append(entry.message)
        elif entry.run:
            prepared.runs.append(entry)
        else:
            prepared.unrun.append(entry)
    return prepared


def begin_all(guard: BatchGuard, runs: Sequence[Entry]) -> tuple[list[Message], list[Entry]]:
    """Begin the claims of ``runs`` (from now on the call finishes them): the messages
    the batch handler receives, and the entries whose claim the caller must release
    now - their message was settled (handed back, expired) after the claim and
    before the call. An entry whose claim was finished already is left out."""
    live: list[Message] = []
    release: list[Entry] = []
    for entry in runs:
        if not guard.begin(entry):
            continue  # released when it was settled
        if entry.message.delivery.settled:
            release.append(entry)
            continue
        live.append(entry.message)
    return live, release
