"""What every raw-loop helper offers (:class:`RawLoop`) and the one way a settlement
decision is carried out on a broker (:func:`carry_out`).

The per-client helpers live with their broker (:mod:`msgpatterns.brokers.redis.raw`,
:mod:`msgpatterns.brokers.kafka.raw`, :mod:`msgpatterns.brokers.rabbitmq.raw`);
:mod:`msgpatterns.raw` is their public face and re-exports these names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from msgpatterns.deadletter import DeadLetter
from msgpatterns.errors import ConfigurationError
from msgpatterns.message import Message
from msgpatterns.retry import RetryPolicy
from msgpatterns.settlement import (
    Ack,
    DeadLetterIt,
    Decision,
    RetryLater,
    RetryNow,
    run_handler,
)

__all__ = ["RawLoop", "Settles", "carry_out"]


class Settles(Protocol):
    """The settling half of the :class:`~msgpatterns.brokers.base.Broker` protocol."""

    def ack(self, message: Message) -> None: ...

    def nack(self, message: Message, delay: float = 0.0) -> None: ...

    def dead_letter(self, message: Message, record: DeadLetter) -> None: ...


def carry_out(broker: Settles, message: Message, decision: Decision) -> None:
    """Settle ``message`` on ``broker`` as ``decision`` says, the way the Consumer does:
    an ack; a redelivery after ``delay`` carrying the decision's headers (failure
    history, attempt + 1); or the dead letter with its full record.

    Raises ``ValueError`` for :class:`~msgpatterns.settlement.RetryNow` (an in-process
    retry is the loop's to run: :func:`~msgpatterns.settlement.run_handler` does it and
    never returns one) and ``TypeError`` for anything that is not a decision.
    """
    if isinstance(decision, Ack):
        broker.ack(message)
    elif isinstance(decision, RetryLater):
        message.headers = dict(decision.headers)
        broker.nack(message, decision.delay)
    elif isinstance(decision, DeadLetterIt):
        broker.dead_letter(message, decision.record)
    elif isinstance(decision, RetryNow):
        raise ConfigurationError(
            "RetryNow is an in-process retry: run the handler again after "
            f"{decision.delay:g}s (run_handler does) instead of settling")
    else:
        raise ConfigurationError(f"not a settlement decision: {decision!r}")


class RawLoop:
    """What every per-client helper offers: :meth:`apply` carries out a decision on
    its client (each helper's own), :meth:`handle` runs a handler and settles it."""

    group: str

    def apply(self, message: Message, decision: Decision) -> None:
        raise NotImplementedError

    def handle(self, message: Message, handler: Callable[[Message], Any], *,
               policy: RetryPolicy) -> Decision:
        """Run ``handler`` on ``message`` (in-process retries included), settle it as
        the policy decides, and return the decision."""
        decision = run_handler(handler, message, policy=policy, group=self.group)
        self.apply(message, decision)
        return decision
