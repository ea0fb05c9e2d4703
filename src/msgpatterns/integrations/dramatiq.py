"""Dramatiq: msgpatterns' retry schedule, dead letters and idempotency for actors.

Put the middleware on the broker *instead of* Dramatiq's ``Retries`` (it takes over
that job; a worker with both refuses to boot)::

    broker = RedisBroker(url="redis://localhost:6379/0")
    use_msgpatterns(broker, RetryPolicy(max_attempts=5),
                    dead_letters=RedisDeadLetterStore("redis://localhost:6379/0"))

    @dramatiq.actor(queue_name="billing")
    @idempotent(RedisChecker(url), key=lambda order_id, amount: order_id)
    def charge(order_id: str, amount: int) -> None: ...

Guarantees, for every message of every actor of the broker:

* The decision is :func:`msgpatterns.settlement.settle` (``RetryPolicy.decide``), the
  Consumer's own rule; an actor may carry its own ``msgpatterns_policy=`` option.
  Success acks. ``NeedRetry()`` runs the actor again in the same worker thread (after
  ``local_backoff``, ``local_retries`` times). ``NeedRetry(delay)``, ``InProgress``,
  Dramatiq's ``Retry(delay=ms)`` and ordinary errors re-enqueue the message with
  Dramatiq's own delay (``broker.enqueue(message, delay=ms)``, its delay queue; never
  before the policy's delay) and then ack the original.
* The attempt count is durable: Dramatiq's ``options["retries"]`` travels in the
  message; attempt = retries + 1. The failure history rides in
  ``options["msgpatterns_headers"]``. A message redelivered because its worker died
  keeps its attempt (Dramatiq does not count such redeliveries).
* ``Reject``, ``fatal`` errors, the actor's ``throws`` and the ``max_attempts``-th
  failure dead-letter the message: the full :class:`~msgpatterns.DeadLetter` record
  goes to ``dead_letters`` (``RedisDeadLetterStore``: ``msgpatterns dlq list --topic
  <queue> redis://...`` lists it; group = the actor name), then the message is failed
  into Dramatiq's own dead-letter queue (``<queue>.XQ``). If the store fails, the
  message still goes to ``<queue>.XQ`` (logged): a dead letter is never lost.
* :func:`resend_replayed` sends what ``msgpatterns dlq replay`` put back to Dramatiq
  again (the original message with its id, attempts reset).

The record's body is the Dramatiq message itself (``Message.encode()``: actor, args,
kwargs, options), so a replay restores exactly what was sent.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from msgpatterns import headers as h
from msgpatterns._extras import require
from msgpatterns.deadletter import DeadLetter, DeadLetterStore
from msgpatterns.errors import ConfigurationError, NeedRetry, describe
from msgpatterns.message import Message
from msgpatterns.retry import RetryPolicy
from msgpatterns.settlement import (
    Ack,
    DeadLetterIt,
    RetryLater,
    RetryNow,
    checked_policy_and_store,
    settle,
)

if TYPE_CHECKING:
    from msgpatterns.integrations.deadletters import RedisDeadLetterStore

require("dramatiq", "dramatiq")

import dramatiq  # noqa: E402
from dramatiq.middleware import Middleware, Retries  # noqa: E402

__all__ = ["MsgpatternsMiddleware", "current_message", "message_id", "resend_replayed",
           "use_msgpatterns"]

log = logging.getLogger("msgpatterns.integrations.dramatiq")

#: The message option that carries the failure history (msgpatterns headers).
HEADERS_OPTION = "msgpatterns_headers"
#: The actor option that gives one actor its own RetryPolicy.
POLICY_OPTION = "msgpatterns_policy"

_current = threading.local()


def current_message() -> Message:
    """The msgpatterns :class:`~msgpatterns.Message` of the Dramatiq message this
    worker thread is processing (id, topic = queue, attempt, headers); a
    :class:`~msgpatterns.errors.ConfigurationError` outside an actor run under
    :class:`MsgpatternsMiddleware`."""
    message: Message | None = getattr(_current, "message", None)
    if message is None:
        raise ConfigurationError("no Dramatiq message is being processed in this thread "
                                 "under MsgpatternsMiddleware")
    return message


def message_id(*args: Any, **kwargs: Any) -> object:
    """A ``key=`` for ``@idempotent`` on an actor: the Dramatiq message id (kept by
    Dramatiq's retries, by redeliveries and by replays; a second ``send()`` is a new
    id)."""
    return current_message().id


def _as_message(message: Any) -> Message:
    options = message.options
    headers = {str(k): str(v) for k, v in (options.get(HEADERS_OPTION) or {}).items()}
    return Message(message.encode(), id=message.message_id, topic=message.queue_name,
                   headers=headers, timestamp=message.message_timestamp / 1000,
                   attempt=int(options.get("retries") or 0) + 1)


class MsgpatternsMiddleware(Middleware):
    """Dramatiq middleware: retries and dead letters by a :class:`RetryPolicy`.

    Args:
        policy: the retry policy (default ``RetryPolicy()``); an actor's
            ``msgpatterns_policy=`` option overrides it.
        dead_letters: where dead-letter records go (``RedisDeadLetterStore`` for
            ``msgpatterns dlq``); None: only Dramatiq's ``<queue>.XQ``.
        sleep: waits between in-process retries.
    """

    def __init__(self, policy: RetryPolicy | None = None, *,
                 dead_letters: DeadLetterStore | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.policy, self.dead_letters = checked_policy_and_store(policy, dead_letters)
        self.sleep = sleep

    @property
    def actor_options(self) -> set[str]:
        return {POLICY_OPTION, "throws"}

    def before_worker_boot(self, broker: Any, worker: Any) -> None:
        refuse_retries(broker)

    def before_process_message(self, broker: Any, message: Any) -> None:
        _current.message = _as_message(message)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        _current.message = None

    def after_process_message(self, broker: Any, message: Any, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        try:
            if exception is not None and not message.failed:
                self._settle(broker, message, exception)
        finally:
            _current.message = None

    def _policy(self, actor: Any) -> RetryPolicy:
        policy = actor.options.get(POLICY_OPTION)
        if policy is None:
            return self.policy
        if not isinstance(policy, RetryPolicy):
            raise ConfigurationError(f"actor {actor.actor_name}: {POLICY_OPTION} must be a "
                                     f"RetryPolicy, got {policy!r}")
        return policy

    def _settle(self, broker: Any, message: Any, exception: BaseException) -> None:
        actor = broker.get_actor(message.actor_name)
        delivery: Message = getattr(_current, "message", None) or _as_message(message)
        group = str(message.actor_name)
        throws = message.options.get("throws") or actor.options.get("throws")
        error: BaseException | None = exception
        while True:
            if throws and isinstance(error, throws):
                record = DeadLetter.from_error(delivery, error, now=time.time(), group=group,
                                               reason=f"expected exception (throws): "
                                                      f"{describe(error)}")
                return self._dead_letter(message, record)
            if isinstance(error, dramatiq.Retry) and error.delay:  # "retry in <ms>"
                error = NeedRetry(error.delay / 1000)
            decision = settle(delivery, error, policy=self._policy(actor), group=group)
            if not isinstance(decision, RetryNow):
                break
            self.sleep(decision.delay)
            delivery.local_retries += 1
            try:
                actor(*message.args, **message.kwargs)
            except Exception as exc:
                error = exc
                continue
            return  # the in-process retry succeeded: acked
        if isinstance(decision, Ack):
            return
        if isinstance(decision, RetryLater):
            log.info("message %s attempt %d failed (%s); redelivering in %.3fs",
                     message.message_id, delivery.attempt, describe(decision.error),
                     decision.delay)
            message.options["retries"] = decision.attempt - 1
            message.options[HEADERS_OPTION] = {
                k: v for k, v in decision.headers.items() if k != h.ATTEMPT}
            broker.enqueue(message, delay=max(1, math.ceil(decision.delay * 1000))
                           if decision.delay > 0 else None)
            return
        assert isinstance(decision, DeadLetterIt)
        self._dead_letter(message, decision.record)

    def _dead_letter(self, message: Any, record: DeadLetter) -> None:
        log.warning("message %s dead-lettered: %s", message.message_id, record.reason)
        try:
            if self.dead_letters is not None:
                self.dead_letters.put(record)
        except Exception as exc:
            log.error("message %s: keeping its dead-letter record failed (%s); it is in "
                      "Dramatiq's %s.XQ only", message.message_id, describe(exc),
                      message.queue_name)
        finally:
            message.fail()


def refuse_retries(broker: Any) -> None:
    """A :class:`~msgpatterns.errors.ConfigurationError` when ``broker`` also runs
    Dramatiq's ``Retries`` (both would retry every failure)."""
    if any(isinstance(m, Retries) for m in broker.middleware):
        raise ConfigurationError(
            "the broker runs both Dramatiq's Retries and MsgpatternsMiddleware, which "
            "would retry every failure twice: build it with use_msgpatterns(broker, ...), "
            "which removes Retries")


def use_msgpatterns(broker: Any, policy: RetryPolicy | None = None, *,
                    dead_letters: DeadLetterStore | None = None) -> MsgpatternsMiddleware:
    """Replace Dramatiq's ``Retries`` on ``broker`` with :class:`MsgpatternsMiddleware`
    (call it before declaring actors); the middleware."""
    middleware = MsgpatternsMiddleware(policy, dead_letters=dead_letters)
    broker.middleware[:] = [m for m in broker.middleware if not isinstance(m, Retries)]
    broker.add_middleware(middleware)
    return middleware


def resend_replayed(broker: Any, store: RedisDeadLetterStore, queue_name: str) -> int:
    """Enqueue again every dead letter of ``queue_name`` that ``msgpatterns dlq replay``
    put back (to an actor's group, or ``--to-topic``); how many. Each goes back as the
    original Dramatiq message (same id, actor, arguments) with its attempt count and
    failure history reset, and leaves Redis only after ``broker.enqueue`` returned (a
    crash in between enqueues it twice; the idempotency key absorbs it)."""

    def send(replayed: Message) -> None:
        original = dramatiq.Message.decode(replayed.raw_body)
        options = {k: v for k, v in original.options.items()
                   if k not in ("retries", HEADERS_OPTION, "eta", "traceback",
                                "requeue_timestamp", "redis_message_id")}
        broker.enqueue(dramatiq.Message(
            queue_name=original.queue_name, actor_name=original.actor_name,
            args=original.args, kwargs=original.kwargs, options=options,
            message_id=original.message_id, message_timestamp=original.message_timestamp))

    count = 0
    actors = [name for name in broker.get_declared_actors()
              if broker.get_actor(name).queue_name == queue_name] or [""]
    for name in actors:
        count += store.take_replays(queue_name, name, send)
    return count
