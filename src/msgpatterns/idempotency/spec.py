"""The :class:`Checker` protocol and checker specs: how a checker travels to another
process (a Spark executor, a worker).

A live checker holds connections, which cannot be pickled. ``checker.spec()`` gives a
:class:`CheckerSpec` - a URL and plain options - and :func:`checker_from_spec` builds
an equivalent checker from it in the receiving process::

    spec = RedisChecker("redis://cache:6379/0", namespace="orders").spec()
    ...                                   # pickled to an executor
    checker = checker_from_spec(spec)     # same store, same namespace, ttl, lease
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

from msgpatterns._redact import hide_password_in, redact_url
from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency.guard import Executed
from msgpatterns.idempotency.policy import StorePolicy
from msgpatterns.idempotency.records import IdempotencyStats
from msgpatterns.idempotency.results import DEFAULT_MAX_RESULT_BYTES

__all__ = ["Checker", "CheckerSpec", "checker_from_spec", "checker_from_url",
           "hide_password_in", "redact_url"]

R = TypeVar("R")

_KINDS = {
    "redis": ("msgpatterns.idempotency.redis_store", "RedisChecker"),
    "sql": ("msgpatterns.idempotency.sql", "SqlChecker"),
    "transactional_sql": ("msgpatterns.idempotency.transactional", "TransactionalSqlChecker"),
}


@runtime_checkable
class Checker(Protocol):
    """What ``@idempotent`` calls on a checker for sync handlers: the guarded call."""

    namespace: str
    stats: IdempotencyStats
    #: True when ``execute`` hands the handler a transaction (``tx``).
    passes_tx: bool

    def store_key(self, key: object, group: str = "") -> str:
        """The key as stored for ``key`` in ``group``."""
        ...

    def execute(
        self, key: object, call: Callable[[Any], R], *, group: str = "",
        fingerprint: str | None = None, fail_open: bool = False,
        store_result: bool = False, max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    ) -> Executed[R]:
        """Run ``call`` at most once per key, following the six rules; with
        ``store_result`` a duplicate's ``Executed.result`` is the stored result."""
        ...

    def spec(self) -> CheckerSpec:
        """A picklable description from which another process rebuilds this checker."""
        ...

    def close(self) -> None:
        """Release connections this checker created."""
        ...



@dataclass(frozen=True)
class CheckerSpec:
    """A picklable description of a checker: its kind, its store URL (with credentials)
    and its options (namespace, ttl, lease, table, store policy...)."""

    kind: str
    url: str
    options: Mapping[str, Any] = field(default_factory=dict)

    def build(self) -> Checker:
        """A new checker for this spec (same as :func:`checker_from_spec`)."""
        return checker_from_spec(self)

    def __repr__(self) -> str:
        """The spec with its URL's password shown as ``***`` (``url`` keeps it)."""
        return (f"CheckerSpec(kind={self.kind!r}, url={redact_url(self.url)!r}, "
                f"options={dict(self.options)!r})")

    __str__ = __repr__


def policy_options(policy: StorePolicy) -> dict[str, Any]:
    """A store policy as spec options (plain values; its ``backoff`` when it has one)."""
    options: dict[str, Any] = {
        "attempts": policy.attempts, "wait": policy.wait, "max_wait": policy.max_wait,
        "unavailable_delay": policy.unavailable_delay,
    }
    if policy.backoff is not None:
        options["backoff"] = policy.backoff
    return options


def checker_from_spec(spec: CheckerSpec) -> Checker:
    """Build the checker ``spec`` describes, with fresh connections."""
    import importlib

    try:
        module, name = _KINDS[spec.kind]
    except KeyError:
        raise ConfigurationError(f"unknown checker kind {spec.kind!r}") from None
    cls = getattr(importlib.import_module(module), name)
    options = dict(spec.options)
    if isinstance(options.get("policy"), Mapping):
        options["policy"] = StorePolicy(**options["policy"])
    try:
        checker: Checker = cls(spec.url, **options)
    except ValueError as exc:
        if isinstance(exc, ConfigurationError):
            raise
        raise ConfigurationError(
            f"cannot build a {name} from {redact_url(spec.url)!r}: "
            f"{hide_password_in(str(exc), spec.url)}"
        ) from None
    return checker


def checker_from_url(url: str, **options: Any) -> Checker:
    """A :class:`RedisChecker` for a ``redis://``, ``rediss://`` or ``unix://`` URL, else
    a :class:`SqlChecker` for an SQLAlchemy URL."""
    kind = "redis" if url.split(":", 1)[0] in ("redis", "rediss", "unix") else "sql"
    return checker_from_spec(CheckerSpec(kind, url, options))
