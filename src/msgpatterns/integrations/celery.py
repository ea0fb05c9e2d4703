"""Celery: idempotent ``acks_late`` tasks with msgpatterns' retry schedule and dead
letters.

::

    @idempotent_task(app, checker, key=lambda order_id, amount: order_id,
                     policy=RetryPolicy(max_attempts=5), dead_letters=store)
    def charge(order_id: str, amount: int) -> None: ...

    charge.delay("o-1", 500)

Guarantees:

* The task is registered with ``acks_late=True``: the broker redelivers a task whose
  worker died mid-way, and ``@idempotent`` (``checker``) runs the body at most once per
  key - the ``key`` callable receives exactly the task's arguments; without ``key``
  the key is the Celery task id (kept by Celery's retries and by redeliveries, not by
  a second ``delay()`` call).
* With a :class:`~msgpatterns.TransactionalSqlChecker` the task runs inside the
  checker's transaction: it must take ``tx`` (keyword) and write through it; its writes
  and the key commit together (exactly once). A task without ``tx`` is refused with a
  :class:`~msgpatterns.errors.ConfigurationError` when it is decorated.
* Every outcome goes through :func:`msgpatterns.settlement.settle`
  (``RetryPolicy.decide``): success returns the result; ``NeedRetry()`` retries
  in-process; ``NeedRetry(delay)``, ``InProgress`` and ordinary errors call Celery's
  ``self.retry(countdown=<the policy's delay>, max_retries=max_attempts - 1)``;
  ``Reject``, ``fatal`` errors and the last attempt put the full
  :class:`~msgpatterns.DeadLetter` record into ``dead_letters`` and fail the task with
  the error (no Celery retry).
* The attempt number is durable: Celery's ``request.retries`` travels in the task
  message, attempt = retries + 1.
* Celery's own ``Retry``, ``Ignore`` and ``Reject`` raised by the body pass through.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from msgpatterns._callables import require_sync_callable
from msgpatterns._escape import escape_control
from msgpatterns._extras import require
from msgpatterns.deadletter import DeadLetterStore
from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency.decorator import accepts_tx, idempotent
from msgpatterns.message import Message
from msgpatterns.retry import RetryPolicy
from msgpatterns.settlement import Ack, DeadLetterIt, RetryLater, RetryNow, settle

if TYPE_CHECKING:
    from msgpatterns.idempotency.base import Checker
    from msgpatterns.integrations.deadletters import RedisDeadLetterStore

require("celery", "celery")

from celery.exceptions import TaskPredicate  # type: ignore[import-untyped]  # noqa: E402

__all__ = ["idempotent_task", "resend_replayed"]

log = logging.getLogger("msgpatterns.integrations.celery")


def _delivery(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Message:
    """The task call as a Message: id = task id, topic = task name, attempt =
    Celery's durable retry count + 1, body = the arguments as JSON."""
    request = task.request
    body = json.dumps({"args": list(args), "kwargs": kwargs}, default=repr).encode()
    return Message(body, id=request.id, topic=task.name,
                   attempt=int(request.retries or 0) + 1)


def _require_tx_parameter(fn: Callable[..., Any]) -> None:
    """A task on a transactional checker must take ``tx`` (keyword) or ``**kwargs``."""
    if accepts_tx(fn):
        return
    raise ConfigurationError(
        f"task {fn.__module__}.{fn.__qualname__} has no 'tx' parameter, but "
        "TransactionalSqlChecker runs the task in its transaction and passes it as tx=: "
        "write def task(order_id, amount, *, tx) and do the task's writes through tx "
        "(or use SqlChecker / RedisChecker, which do not pass a transaction)"
    )


def idempotent_task(
    app: Any,
    checker: Checker | None = None,
    *,
    key: Callable[..., object] | None = None,
    policy: RetryPolicy | None = None,
    dead_letters: DeadLetterStore | None = None,
    group: str | None = None,
    sleep: Callable[[float], None] = time.sleep,
    **task_options: Any,
) -> Callable[[Callable[..., Any]], Any]:
    """Register the decorated function as a Celery task of ``app`` (``acks_late``,
    bound) that runs once per key and retries on the policy's schedule.

    Args:
        app: the Celery application.
        checker: where idempotency keys live (any msgpatterns checker); None: no
            idempotency, retries and dead letters only.
        key: called with exactly the task's arguments, returns the key; default: the
            Celery task id.
        policy: the retry policy (default ``RetryPolicy()``).
        dead_letters: where records of given-up tasks go:
            :class:`~msgpatterns.integrations.deadletters.RedisDeadLetterStore` (the
            stream ``<task name>:dlq``, which ``msgpatterns dlq`` lists and replays;
            :func:`resend_replayed` sends replays back to Celery),
            :class:`~msgpatterns.deadletter.MemoryDeadLetterStore` or your store;
            None: they are only logged.
        group: the idempotency group and the records' group (default: the function's
            ``module.qualname``).
        sleep: waits between in-process retries.
        task_options: more ``app.task`` options (``name``, ``queue``, ...).
    """
    if policy is not None and not isinstance(policy, RetryPolicy):
        raise ConfigurationError(f"policy must be a RetryPolicy, got {policy!r}")
    if dead_letters is not None and not callable(getattr(dead_letters, "put", None)):
        raise ConfigurationError(f"dead_letters must be a DeadLetterStore, got {dead_letters!r}")
    if key is not None:
        require_sync_callable(key, what="key", where="idempotent_task")
    if checker is not None and not callable(getattr(checker, "execute", None)) \
            and callable(getattr(checker, "aexecute", None)):
        sync_name = type(checker).__name__.removeprefix("Async")
        raise ConfigurationError(
            f"idempotent_task runs sync Celery tasks, but {type(checker).__name__} guards "
            f"async def handlers: use {sync_name}")
    rules = policy if policy is not None else RetryPolicy()
    if task_options.get("acks_late") is False or task_options.get("bind") is False:
        raise ConfigurationError("idempotent_task registers acks_late=True, bind=True tasks")

    def decorate(fn: Callable[..., Any]) -> Any:
        require_sync_callable(fn, what="task", where="idempotent_task",
                              alternative="a sync function (Celery runs sync tasks)")
        name = group or f"{fn.__module__}.{fn.__qualname__}"
        passes_tx = bool(getattr(checker, "passes_tx", False))
        if passes_tx:
            _require_tx_parameter(fn)

        def body(message: Message, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return fn(*args, **kwargs)

        def body_in_tx(message: Message, args: tuple[Any, ...], kwargs: dict[str, Any],
                       tx: Any) -> Any:
            return fn(*args, tx=tx, **kwargs)

        def key_of(message: Message, args: tuple[Any, ...], kwargs: dict[str, Any]) -> object:
            return key(*args, **kwargs) if key is not None else message.id

        run: Callable[..., Any] = body
        if checker is not None:
            guarded = body_in_tx if passes_tx else body
            # Errors about the guarded call name the task, not this adapter's inner function.
            guarded.__module__, guarded.__qualname__ = fn.__module__, fn.__qualname__
            run = idempotent(checker, key=key_of, group=name)(guarded)

        @functools.wraps(fn)
        def task(self: Any, *args: Any, **kwargs: Any) -> Any:
            message = _delivery(self, args, kwargs)
            while True:
                error: Exception | None = None
                result: Any = None
                try:
                    result = run(message, args, kwargs)
                except TaskPredicate:
                    raise
                except Exception as exc:
                    error = exc
                decision = settle(message, error, policy=rules, group=name, result=result)
                if not isinstance(decision, RetryNow):
                    break
                sleep(decision.delay)
                message.local_retries += 1
            if isinstance(decision, Ack):
                return decision.result
            if isinstance(decision, RetryLater):
                raise self.retry(exc=decision.error, countdown=decision.delay,
                                 max_retries=rules.max_attempts - 1)
            assert isinstance(decision, DeadLetterIt)
            log.warning("task %s[%s] dead-lettered: %s", self.name,
                        escape_control(message.id), escape_control(decision.reason))
            if dead_letters is not None:
                dead_letters.put(decision.record)
            assert error is not None
            raise error

        options = {"bind": True, "acks_late": True, **task_options,
                   "msgpatterns_group": name}
        return app.task(**options)(task)

    return decorate


def resend_replayed(task: Any, store: RedisDeadLetterStore) -> int:
    """Send every dead letter of ``task`` that ``msgpatterns dlq replay`` put back
    (``--group <the task's group>`` or ``--to-topic``) to Celery again, as a new run of
    ``task`` with its arguments and its original task id; how many.

    Each replayed message is deleted from Redis only after ``apply_async`` returned: a
    crash in between sends it twice (the idempotency key absorbs it), never loses it.
    Arguments went through JSON in the record: values that are not JSON (dates,
    objects) come back as their ``repr``.
    """
    group = getattr(task, "msgpatterns_group", None)
    if not group:
        raise ConfigurationError(f"{task!r} is not an idempotent_task")

    def send(message: Message) -> None:
        call = json.loads(message.raw_body)
        task.apply_async(tuple(call.get("args") or ()), call.get("kwargs") or {},
                         task_id=message.id)

    return store.take_replays(task.name, group, send)
