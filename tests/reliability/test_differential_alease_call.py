"""Differential: an async lease checker's direct-style hot path vs its plain twin.

``AsyncDriver.aexecute`` (so every ``@idempotent`` call of an ``async def`` handler)
runs :func:`msgpatterns.idempotency.lease_call.alease_call`, the six rules written as
plain awaits; its plain twin is ``adrive(lease_steps(...))``, the rules as steps, which
every other async path runs. The schedules, the twins' journals and the checks are
those of ``test_differential_lease_call.py`` (the sync hot path): guarded calls whose
handlers return, return what JSON cannot store, raise an Exception or a BaseException;
fingerprints; another owner; expiring leases and records; transient store faults;
write-behind flushes; ``store_result``, ``fail_open``, retries. After every step the two
must agree exactly: outcome, handler runs, stored records, counters, round trips, logs.

On an in-memory store with a fake clock (an :class:`AsyncLeaseChecker` over it), and
on the real Redis (:class:`AsyncRedisChecker`, ``@pytest.mark.redis``). Each twin runs
its steps on an event loop of its own.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from reliability_harness import examples
from test_differential_lease_call import (
    FOREIGN,
    KEYS,
    LEASE,
    TTL,
    Crash,
    RedisTwin,
    Schedule,
    Twin,
    _FaultyMemoryStore,
    check_twins,
    schedules,
)

from msgpatterns.idempotency.base import AsyncLeaseChecker
from msgpatterns.idempotency.guard import ClaimRequest, Executed, adrive, lease_steps
from msgpatterns.idempotency.memory import MemoryStore
from msgpatterns.idempotency.results import DEFAULT_MAX_RESULT_BYTES
from msgpatterns.idempotency.store import AsyncAdapter

pytestmark = pytest.mark.timeout(900)


async def plain_aexecute(checker: Any, key: object, call: Any, *, group: str = "",
                         fingerprint: str | None = None, fail_open: bool = False,
                         store_result: bool = False,
                         max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> Executed[Any]:
    """``AsyncDriver.aexecute`` as it was: the steps, driven by ``adrive``."""
    from msgpatterns.idempotency.base import checker_options

    checker._check_open()
    steps = lease_steps(checker.rules, checker.keys.build(key, group), fingerprint,
                        checker_options(fail_open, store_result, max_result_bytes,
                                        checker.result_key))
    return await adrive(steps, checker._aperform, call)


class AsyncTwin(Twin):
    """One side on an async lease checker over the faulty in-memory store."""

    def _build(self) -> Any:
        self.loop = asyncio.new_event_loop()
        self.now = 0.0
        store = _FaultyMemoryStore(self.journal, lambda: self.now)
        self.memory = store
        return AsyncLeaseChecker(AsyncAdapter(store), ttl=TTL, lease=LEASE,
                                 max_key_bytes=512, namespace="diff", policy=self._policy(),
                                 write_behind=LEASE - 1 if self.schedule.write_behind
                                 else None)

    def _call(self, index: int, key: int, behaviour: str, fingerprint: str | None) -> Any:
        name = KEYS[key]

        async def handler(tx: Any) -> Any:
            self.journal.runs.append(f"{index}:{name}")
            if behaviour == "raise":
                raise ValueError(f"handler failed at step {index}")
            if behaviour == "crash":
                raise Crash(f"killed at step {index}")
            if behaviour == "unstorable":
                return {index}  # a set: not JSON
            return {"step": index}

        execute = plain_aexecute if self.plain else type(self.checker).aexecute

        async def run() -> Any:
            try:
                outcome = await execute(self.checker, name, handler, group="g",
                                        fingerprint=fingerprint,
                                        fail_open=self.schedule.fail_open,
                                        store_result=self.schedule.store_result)
            except BaseException as exc:
                return ("raised", type(exc).__name__, self._text(exc), self._delay(exc),
                        type(exc.__cause__).__name__ if exc.__cause__ else None)
            claim = None if outcome.claim is None else self._claim(outcome.claim)
            return ("ran" if outcome.ran else "skipped", repr(outcome.result), claim)

        return self.loop.run_until_complete(run())

    def store_claim(self, store_key: str) -> None:
        faults, self.journal.faults = self.journal.faults, {}  # never a fault here
        trips = list(self.journal.trips)
        try:
            self._foreign_claim(ClaimRequest(store_key, FOREIGN, None))
        finally:
            self.journal.faults = faults
            self.journal.trips[:] = trips

    def _foreign_claim(self, request: ClaimRequest) -> None:
        self.memory.claim_many([request])

    def _flush(self, index: int) -> None:
        self.loop.run_until_complete(self.checker.aflush())

    def records(self) -> Any:
        assert isinstance(self.memory, MemoryStore)
        return dict(self.memory._records)

    def close(self) -> None:
        self.journal.faults.clear()
        self.loop.run_until_complete(self.checker.aclose())
        self.loop.close()


@settings(max_examples=examples(3), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(schedules)
def test_the_async_hot_path_and_its_plain_twin_agree_in_memory(schedule: Schedule) -> None:
    check_twins(schedule, AsyncTwin(False, schedule), AsyncTwin(True, schedule))


# -- on Redis ------------------------------------------------------------------------------


class AsyncRedisTwin(AsyncTwin, RedisTwin):
    """An AsyncRedisChecker on the real server; the plain twin sends the batch scripts;
    records are read, and leases expired, by a sync client."""

    def _build(self) -> Any:
        import redis
        import redis.asyncio

        from msgpatterns.idempotency import AsyncRedisChecker

        self.loop = asyncio.new_event_loop()
        db = 6 if self.plain else 5  # the same keys for both twins, a database each
        self.client = redis.Redis.from_url(self.url, db=db)
        self.aclient = redis.asyncio.Redis.from_url(self.url, db=db)
        checker = AsyncRedisChecker(self.aclient, namespace=self.namespace, ttl=TTL,
                                    lease=LEASE, policy=self._policy(),
                                    write_behind=LEASE - 1 if self.schedule.write_behind
                                    else None)
        store = checker.astore
        scripts = store.scripts  # type: ignore[attr-defined]
        by_sha = {}
        for script, op in ((scripts.claim, "claim_many"), (scripts.complete, "complete_many"),
                           (scripts.release, "release_many")):
            by_sha[script.sha] = op
            if script.one is not None:
                by_sha[script.one.sha] = op
                if self.plain:
                    script.one = None  # the batch scripts, even for one key
        link = store.link  # type: ignore[attr-defined]
        send, send_script = link.call, link.script

        async def counted(op: str, keys: int, send: Any) -> Any:
            self.journal.attempt(op, keys)
            try:
                return await send()
            except redis.exceptions.NoScriptError:
                self.journal.trips.pop()  # a flushed script cache: loaded and sent again
                raise

        async def call(*args: Any) -> Any:
            if args[0] != "EVALSHA":
                return await send(*args)
            return await counted(by_sha[args[1]], int(args[2]), lambda: send(*args))

        async def script(command: Any, rest: tuple[Any, ...]) -> Any:
            return await counted(by_sha[command.words[1]], command.words[2],
                                 lambda: send_script(command, rest))

        link.call, link.script = call, script
        self.store = store
        return checker

    def _foreign_claim(self, request: ClaimRequest) -> None:
        self.loop.run_until_complete(self.store.claim_many([request]))

    def records(self) -> Any:
        return RedisTwin.records(self)

    def close(self) -> None:
        self.journal.faults.clear()
        self.loop.run_until_complete(self.checker.aclose())
        self.loop.run_until_complete(self.aclient.aclose())
        self.loop.close()
        self._expire_all(0)
        self.client.close()


@pytest.mark.redis
def test_the_async_hot_path_and_its_plain_twin_agree_on_redis(redis_url: str) -> None:
    AsyncRedisTwin.url = redis_url

    @settings(max_examples=examples(0.5), deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(schedules)
    def agree(schedule: Schedule) -> None:
        AsyncRedisTwin.namespace = f"diff-{uuid.uuid4().hex[:12]}"
        check_twins(schedule, AsyncRedisTwin(False, schedule), AsyncRedisTwin(True, schedule))

    agree()
