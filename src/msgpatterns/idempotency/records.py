"""What a checker tells its caller about one key: the :class:`Claim`, and the counters.

A key is *absent*, ``PROCESSING`` (an owner token and a lease) or ``DONE`` (kept for
the checker's ``ttl``). A claim reports which of these the caller found and, when it
won the key, the owner token it must present to complete or release it.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

from msgpatterns.observability import stats as _obs

__all__ = ["PROCESSING", "DONE", "Claim", "IdempotencyStats", "Record", "Status"]

#: Stored state of a key whose owner is still working (its lease may expire).
PROCESSING = "P"
#: Stored state of a key whose effect is applied.
DONE = "D"


class Status(enum.Enum):
    """The outcome of a claim."""

    #: The caller owns the key: apply the effect, then ``complete`` (or ``release``).
    CLAIMED = "claimed"
    #: The effect was applied already: skip it and acknowledge the message.
    DONE = "done"
    #: Another owner holds a live lease: try again after ``Claim.remaining`` seconds.
    IN_PROGRESS = "in_progress"
    #: The key is known with a different payload fingerprint.
    CONFLICT = "conflict"


class Claim(NamedTuple):
    """The result of claiming one key.

    Attributes:
        key: the key as stored (``namespace:group:key``, or its SHA-256 form).
        status: what the claim found, see :class:`Status`.
        token: the owner token, set only when ``status`` is ``CLAIMED``.
        remaining: seconds left on the other owner's lease (``IN_PROGRESS``), else 0.
        fingerprint: the payload fingerprint the claim was made with, if any.
        result: for ``DONE``, the stored result text (see
            :mod:`msgpatterns.idempotency.results`; read it with
            :meth:`stored_result`), None when none was kept.
    """

    key: str
    status: Status
    token: str | None = None
    remaining: float = 0.0
    fingerprint: str | None = None
    result: str | None = None

    @property
    def claimed(self) -> bool:
        """True when the caller owns the key."""
        return self.status is Status.CLAIMED

    def stored_result(self, result_key: bytes | None = None) -> Any:
        """The result stored with this DONE key (``store_result``), decoded from JSON.

        Raises :class:`~msgpatterns.idempotency.results.ResultNotStored` when the
        record holds none (too large, not serialisable, or completed without it), and
        :class:`~msgpatterns.idempotency.results.ResultIntegrityError` when
        ``result_key`` (the checker's) is given and the result is not signed with it.
        """
        from msgpatterns.idempotency.results import decode_result

        return decode_result(self.result, self.key, result_key)


class Record(NamedTuple):
    """A key's stored state as a store observed it, right after a claim attempt.

    ``remaining`` is the time left before the record expires (the lease for
    ``PROCESSING``, the ttl for ``DONE``), in seconds. ``result`` is the stored
    result text of a ``DONE`` record, if any.
    """

    state: str
    token: str
    fingerprint: str | None
    remaining: float
    result: str | None = None


@dataclass
class IdempotencyStats:
    """Counters of what a checker did since it was created. Thread-safe."""

    claimed: int = 0
    completed: int = 0
    released: int = 0
    duplicates: int = 0
    in_progress: int = 0
    conflicts: int = 0
    lost_leases: int = 0
    store_errors: int = 0
    unavailable: int = 0
    processed_without_dedup: int = 0
    #: Keys completed without their result (``store_result``): too large or not JSON.
    results_not_stored: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        #: Who counts here (the checker's class), for telemetry.
        self.owner = ""

    def add(self, name: str, count: int = 1) -> None:
        """Add ``count`` to counter ``name`` (and report it to the telemetry listener)."""
        with self._lock:
            setattr(self, name, getattr(self, name) + count)
        listener = _obs.listener
        if listener is not None:
            _obs.report(listener.idempotency_counted, self.owner, {name: count})

    def count_error(self, error: BaseException) -> None:
        """Count one store error (a transient one, about to be retried or not)."""
        self.add("store_errors")

    def add_all(self, counts: Mapping[str, int]) -> None:
        """Add several counters at once (and report them to the telemetry listener)."""
        with self._lock:
            for name, count in counts.items():
                setattr(self, name, getattr(self, name) + count)
        listener = _obs.listener
        if listener is not None:
            _obs.report(listener.idempotency_counted, self.owner, counts)

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict."""
        with self._lock:
            return {f.name: getattr(self, f.name) for f in fields(self)}
