"""MemoryChecker: the idempotency state machine in a dict, for tests and single processes."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Self

from msgpatterns.errors import ConfigurationError, seconds
from msgpatterns.idempotency.base import AsyncDriver, LeaseChecker
from msgpatterns.idempotency.guard import ClaimRequest
from msgpatterns.idempotency.policy import StorePolicy
from msgpatterns.idempotency.records import DONE, PROCESSING, Record
from msgpatterns.idempotency.store import AsyncAdapter

if TYPE_CHECKING:
    from msgpatterns.idempotency.spec import CheckerSpec

__all__ = ["MemoryChecker", "MemoryStore"]


class MemoryStore:
    """The records in a dict: key -> (state, token, fingerprint, expires_at, stored
    result text). Thread-safe; expired records are swept as the dict grows."""

    transient: tuple[type[BaseException], ...] = ()

    def __init__(self, ttl: float, lease: float, clock: Callable[[], float]) -> None:
        self.ttl, self.lease, self.clock = ttl, lease, clock
        self._lock = threading.Lock()
        self._records: dict[str, tuple[str, str, str | None, float, str | None]] = {}
        self._sweep_at = 1024

    def claim_many(self, requests: Sequence[ClaimRequest]) -> list[Record]:
        records = []
        with self._lock:
            now = self.clock()
            for key, token, fingerprint, _ in requests:
                found = self._records.get(key)
                if found is None or found[3] <= now:  # absent, lease or ttl expired
                    found = (PROCESSING, token, fingerprint, now + self.lease, None)
                    self._records[key] = found
                records.append(Record(found[0], found[1], found[2], found[3] - now, found[4]))
            if len(self._records) >= self._sweep_at:
                self.sweep(now)
        return records

    def complete_many(self, items: Sequence[ClaimRequest]) -> list[bool]:
        done = []
        with self._lock:
            now = self.clock()
            for key, token, fingerprint, result in items:
                found = self._records.get(key)
                ok = found is None or found[1] == token
                if ok and (found is None or found[0] == PROCESSING):
                    self._records[key] = (DONE, token, fingerprint, now + self.ttl, result)
                done.append(ok)
        return done

    def release_many(self, items: Sequence[ClaimRequest]) -> list[bool]:
        released = []
        with self._lock:
            for key, token, _, _ in items:
                found = self._records.get(key)
                ok = found is not None and found[0] == PROCESSING and found[1] == token
                if ok:
                    del self._records[key]
                released.append(ok)
        return released

    def sweep(self, now: float, older_than: float = 0.0) -> int:
        expired = [k for k, r in self._records.items() if r[3] <= now - older_than]
        for key in expired:
            del self._records[key]
        self._sweep_at = max(1024, 2 * len(self._records))
        return len(expired)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()


class MemoryChecker(AsyncDriver, LeaseChecker):
    """Thread-safe in-process checker, for sync and ``async def`` handlers alike.

    Same rules and semantics as the shared-store checkers, within one process: state
    is lost when the process exits, so a crash or restart forgets every key. Expired
    records are swept as the dict grows, or by :meth:`purge`.

    Args:
        ttl: seconds a DONE key is remembered.
        lease: seconds a claim holds a key before another caller may take it over.
        clock: seconds as a float (default ``time.monotonic``); tests may pass a fake.
    """

    store: MemoryStore

    def __init__(
        self,
        ttl: float | timedelta = 86400,
        lease: float | timedelta = 30,
        *,
        namespace: str = "msgpatterns",
        max_key_bytes: int | None = 512,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        lease_s, ttl_s = seconds(lease) or 0.0, seconds(ttl) or 0.0
        super().__init__(MemoryStore(ttl_s, lease_s, clock), namespace=namespace, ttl=ttl,
                         lease=lease, max_key_bytes=max_key_bytes,
                         policy=StorePolicy(attempts=1))
        self.astore = AsyncAdapter(self.store)  # type: ignore[assignment]

    def __len__(self) -> int:
        """Records held, expired ones included until swept."""
        return len(self.store._records)

    def purge(self, older_than: float | timedelta | None = None) -> int:
        """Forget records that expired at least ``older_than`` seconds ago."""
        self._check_open()
        with self.store._lock:
            return self.store.sweep(self.clock(), seconds(older_than) or 0.0)

    def reset(self) -> None:
        """Forget every key and zero :attr:`stats`: the checker is as new, and it is
        the same object, so the handlers decorated with it need not be rebuilt (for
        tests: between the schedules of
        :func:`~msgpatterns.testing.explore_schedules`, between test cases). Do not
        call it while handlers run: a key claimed before it is forgotten."""
        self._check_open()
        self.store.clear()
        for name in [f.name for f in dataclasses.fields(self.stats)]:
            setattr(self.stats, name, 0)

    def _close(self) -> None:
        self.store.clear()

    async def aclose(self) -> None:
        """:meth:`close`, for code that closes async checkers."""
        self.close()

    async def __aenter__(self) -> Self:
        """``async with checker:`` (``with checker:`` works too) - the block's end
        closes it."""
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def spec(self) -> CheckerSpec:
        """Not available: a MemoryChecker's state cannot leave its process."""
        raise ConfigurationError(
            "a MemoryChecker lives in one process and cannot be rebuilt elsewhere; "
            "use RedisChecker or SqlChecker (SQLite file) for executors"
        )
