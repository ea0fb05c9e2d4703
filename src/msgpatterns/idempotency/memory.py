"""MemoryChecker: the idempotency state machine in a dict, for tests and single processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from msgpatterns.errors import ConfigurationError, seconds
from msgpatterns.idempotency.base import ClaimRequest, LeaseChecker
from msgpatterns.idempotency.policy import StorePolicy
from msgpatterns.idempotency.records import DONE, PROCESSING, Record

if TYPE_CHECKING:
    from msgpatterns.idempotency.spec import CheckerSpec

__all__ = ["MemoryChecker"]


class MemoryChecker(LeaseChecker):
    """Thread-safe in-process checker.

    Same rules and semantics as the shared-store checkers, within one process: state
    is lost when the process exits, so a crash or restart forgets every key. Expired
    records are swept as the dict grows, or by :meth:`purge`.

    Args:
        ttl: seconds a DONE key is remembered.
        lease: seconds a claim holds a key before another caller may take it over.
        clock: seconds as a float (default ``time.monotonic``); tests may pass a fake.
    """

    def __init__(
        self,
        ttl: float | timedelta = 86400,
        lease: float | timedelta = 30,
        *,
        namespace: str = "msgpatterns",
        max_key_bytes: int | None = 512,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(namespace=namespace, ttl=ttl, lease=lease,
                         max_key_bytes=max_key_bytes, policy=StorePolicy(attempts=1))
        self.clock = clock
        self._lock = threading.Lock()
        # key -> (state, token, fingerprint, expires_at, stored result text)
        self._records: dict[str, tuple[str, str, str | None, float, str | None]] = {}
        self._sweep_at = 1024

    def __len__(self) -> int:
        """Records held, expired ones included until swept."""
        return len(self._records)

    def _claim_records(self, requests: Sequence[ClaimRequest]) -> list[Record]:
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
                self._sweep(now)
        return records

    def _complete_records(self, items: Sequence[ClaimRequest]) -> list[bool]:
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

    def _release_records(self, items: Sequence[ClaimRequest]) -> list[bool]:
        released = []
        with self._lock:
            for key, token, _, _ in items:
                found = self._records.get(key)
                ok = found is not None and found[0] == PROCESSING and found[1] == token
                if ok:
                    del self._records[key]
                released.append(ok)
        return released

    def _sweep(self, now: float, older_than: float = 0.0) -> int:
        expired = [k for k, r in self._records.items() if r[3] <= now - older_than]
        for key in expired:
            del self._records[key]
        self._sweep_at = max(1024, 2 * len(self._records))
        return len(expired)

    def purge(self, older_than: float | timedelta | None = None) -> int:
        """Forget records that expired at least ``older_than`` seconds ago."""
        self._check_open()
        with self._lock:
            return self._sweep(self.clock(), seconds(older_than) or 0.0)

    def _close(self) -> None:
        with self._lock:
            self._records.clear()

    def spec(self) -> CheckerSpec:
        """Not available: a MemoryChecker's state cannot leave its process."""
        raise ConfigurationError(
            "a MemoryChecker lives in one process and cannot be rebuilt elsewhere; "
            "use RedisChecker or SqlChecker (SQLite file) for executors"
        )
