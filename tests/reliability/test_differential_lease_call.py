"""Differential: a sync lease checker's direct-style hot path vs its plain twin.

``LeaseChecker.execute`` (so every ``@idempotent`` call of a sync handler) runs
:func:`msgpatterns.idempotency.lease_call.lease_call`, the six rules written as plain
calls; its plain twin is ``drive(lease_steps(...))``, the rules as steps, which every
other path runs. On Redis the hot path also sends the single-key form of each script
(``CLAIM_ONE``, ``COMPLETE_ONE``, ``RELEASE_ONE``); the twin sends the batch scripts.

Hypothesis generates a schedule - guarded calls on a few keys, each handler returning,
returning what JSON cannot store, raising an Exception or a BaseException; payload
fingerprints; another owner claiming a key; every lease (or every record) expiring;
transient store faults on claim, complete or release; write-behind flushes; with or
without ``store_result``, ``fail_open``, write-behind and a retry - and two twin
checkers run it step by step, with the same owner tokens. After every step they must
agree exactly: the call's outcome (ran, skipped, or the error's type, text, delay and
cause), the handler's runs, the stored records, the counters, the store round trips
(operation and keys, failed attempts included) and the lines logged.

On an in-memory store with a fake clock, and on the real Redis (``@pytest.mark.redis``,
expiry simulated by deleting the records that would have expired).
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_harness import examples

from msgpatterns.idempotency import guard, lease_call
from msgpatterns.idempotency.base import LeaseChecker
from msgpatterns.idempotency.guard import ClaimRequest, Executed, Options, drive, lease_steps
from msgpatterns.idempotency.memory import MemoryStore
from msgpatterns.idempotency.policy import StorePolicy
from msgpatterns.idempotency.results import DEFAULT_MAX_RESULT_BYTES
from msgpatterns.retry import Backoff

pytestmark = pytest.mark.timeout(900)

TTL, LEASE = 1000.0, 30.0
KEYS = ("k0", "k1", "k2", "k3")
OPS = ("claim_many", "complete_many", "release_many")
BEHAVIOURS = ("ok", "ok", "ok", "unstorable", "raise", "crash")
FOREIGN = "f" * 32


class Crash(BaseException):
    """A handler killed by something that is not an Exception."""


class Fault(ConnectionError):
    """An injected transient store error."""


# -- schedules -----------------------------------------------------------------------------

_call = st.tuples(st.just("call"), st.integers(0, len(KEYS) - 1), st.sampled_from(BEHAVIOURS),
                  st.sampled_from([None, "a", "b"]))
_step = st.one_of(
    _call, _call, _call,
    st.tuples(st.just("foreign"), st.integers(0, len(KEYS) - 1)),
    st.just(("expire_leases",)),
    st.just(("expire_all",)),
    st.tuples(st.just("fault"), st.sampled_from(OPS), st.integers(1, 3)),
    st.just(("flush",)),
)


@dataclass(frozen=True)
class Schedule:
    steps: list[tuple[Any, ...]]
    store_result: bool
    fail_open: bool
    write_behind: bool
    attempts: int


schedules = st.builds(Schedule, st.lists(_step, min_size=1, max_size=30), st.booleans(),
                      st.booleans(), st.booleans(), st.sampled_from([1, 2]))


# -- the twins -----------------------------------------------------------------------------


@dataclass
class Journal:
    """What one twin did: round trips (failed attempts included), handler runs, logs."""

    trips: list[tuple[str, int]] = field(default_factory=list)
    runs: list[str] = field(default_factory=list)
    logs: list[tuple[str, str]] = field(default_factory=list)
    faults: dict[str, int] = field(default_factory=dict)

    def attempt(self, op: str, keys: int) -> None:
        self.trips.append((op, keys))
        if self.faults.get(op, 0) > 0:
            self.faults[op] -= 1
            raise Fault(f"injected {op} fault")


class Tokens:
    """Owner tokens in the same sequence for both twins."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> str:
        self.count += 1
        return f"{self.count:032x}"


@contextmanager
def tokens_from(source: Tokens) -> Iterator[None]:
    saved = guard.new_token, lease_call.new_token
    guard.new_token = lease_call.new_token = source  # type: ignore[assignment]
    try:
        yield
    finally:
        guard.new_token, lease_call.new_token = saved  # type: ignore[assignment]


class _Logs(logging.Handler):
    def __init__(self, journal: Journal) -> None:
        super().__init__(logging.DEBUG)
        self.journal = journal

    def emit(self, record: logging.LogRecord) -> None:
        self.journal.logs.append((record.levelname, record.getMessage()))


def plain_execute(checker: LeaseChecker, key: object, call: Callable[[Any], Any], *,
                  group: str = "", fingerprint: str | None = None, fail_open: bool = False,
                  store_result: bool = False,
                  max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES) -> Executed[Any]:
    """``LeaseChecker.execute`` as it was: the steps, driven."""
    checker._check_open()
    steps = lease_steps(checker.rules, checker.keys.build(key, group), fingerprint,
                        Options(fail_open, store_result, max_result_bytes, checker.result_key))
    return drive(steps, checker._perform, call)


class _FaultyMemoryStore(MemoryStore):
    transient = (Fault,)

    def __init__(self, journal: Journal, clock: Callable[[], float]) -> None:
        super().__init__(TTL, LEASE, clock)
        self.journal = journal

    def claim_many(self, requests: Any) -> Any:
        self.journal.attempt("claim_many", len(requests))
        return super().claim_many(requests)

    def complete_many(self, items: Any) -> Any:
        self.journal.attempt("complete_many", len(items))
        return super().complete_many(items)

    def release_many(self, items: Any) -> Any:
        self.journal.attempt("release_many", len(items))
        return super().release_many(items)


class Twin:
    """One side: a checker, its journal, its token source and how the store is read."""

    def __init__(self, plain: bool, schedule: Schedule) -> None:
        self.plain = plain
        self.schedule = schedule
        self.journal = Journal()
        self.tokens = Tokens()
        self.checker = self._build()
        self.logger = logging.getLogger("msgpatterns.idempotency")

    def _policy(self) -> StorePolicy:
        return StorePolicy(attempts=self.schedule.attempts, backoff=Backoff.fixed(0))

    def _build(self) -> LeaseChecker:
        self.now = 0.0
        store = _FaultyMemoryStore(self.journal, lambda: self.now)
        return LeaseChecker(store, ttl=TTL, lease=LEASE, max_key_bytes=512,
                            namespace="diff", policy=self._policy(),
                            write_behind=LEASE - 1 if self.schedule.write_behind else None)

    # -- steps ---------------------------------------------------------------------------

    def run(self, step: tuple[Any, ...], index: int) -> Any:
        handler = _Logs(self.journal)
        self.logger.addHandler(handler)
        level = self.logger.level
        self.logger.setLevel(logging.DEBUG)
        try:
            with tokens_from(self.tokens):
                return getattr(self, f"_{step[0]}")(index, *step[1:])
        finally:
            self.logger.removeHandler(handler)
            self.logger.setLevel(level)

    def _call(self, index: int, key: int, behaviour: str, fingerprint: str | None) -> Any:
        name = KEYS[key]

        def handler(tx: Any) -> Any:
            self.journal.runs.append(f"{index}:{name}")
            if behaviour == "raise":
                raise ValueError(f"handler failed at step {index}")
            if behaviour == "crash":
                raise Crash(f"killed at step {index}")
            if behaviour == "unstorable":
                return {index}  # a set: not JSON
            return {"step": index}

        execute = plain_execute if self.plain else type(self.checker).execute
        try:
            outcome = execute(self.checker, name, handler, group="g", fingerprint=fingerprint,
                              fail_open=self.schedule.fail_open,
                              store_result=self.schedule.store_result)
        except BaseException as exc:
            return ("raised", type(exc).__name__, self._text(exc), self._delay(exc),
                    type(exc.__cause__).__name__ if exc.__cause__ else None)
        claim = None if outcome.claim is None else self._claim(outcome.claim)
        return ("ran" if outcome.ran else "skipped", repr(outcome.result), claim)

    def _delay(self, exc: BaseException) -> Any:
        return getattr(exc, "delay", None)

    def _text(self, exc: BaseException) -> str:
        return str(exc)

    def _claim(self, claim: Any) -> Any:
        return claim

    def _foreign(self, index: int, key: int) -> None:
        self.store_claim(self.checker.store_key(KEYS[key], "g"))

    def store_claim(self, store_key: str) -> None:
        inner = self.checker.store
        journal, self.journal.faults = self.journal.faults, {}  # never a fault here
        trips = list(self.journal.trips)
        try:
            inner.claim_many([ClaimRequest(store_key, FOREIGN, None)])
        finally:
            self.journal.faults = journal
            self.journal.trips[:] = trips

    def _expire_leases(self, index: int) -> None:
        self.now += LEASE + 1

    def _expire_all(self, index: int) -> None:
        self.now += TTL + 1

    def _fault(self, index: int, op: str, count: int) -> None:
        self.journal.faults[op] = self.journal.faults.get(op, 0) + count

    def _flush(self, index: int) -> None:
        self.checker.flush(30)

    def records(self) -> Any:
        store = self.checker.store
        assert isinstance(store, MemoryStore)
        return dict(store._records)

    def close(self) -> None:
        self.journal.faults.clear()
        self.checker.close()


def check_twins(schedule: Schedule, fast: Twin, plain: Twin) -> None:
    try:
        for index, step in enumerate(schedule.steps):
            got = fast.run(step, index), plain.run(step, index)
            where = f"step {index} {step} of {schedule}"
            assert got[0] == got[1], where
            assert fast.journal.runs == plain.journal.runs, where
            assert fast.journal.trips == plain.journal.trips, where
            assert fast.journal.logs == plain.journal.logs, where
            assert fast.checker.stats.as_dict() == plain.checker.stats.as_dict(), where
            assert fast.records() == plain.records(), where
    finally:
        fast.close()
        plain.close()


@settings(max_examples=examples(3), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(schedules)
def test_the_hot_path_and_its_plain_twin_agree_in_memory(schedule: Schedule) -> None:
    check_twins(schedule, Twin(False, schedule), Twin(True, schedule))


# -- on Redis ------------------------------------------------------------------------------


class RedisTwin(Twin):
    """A RedisChecker on the real server; the plain twin sends the batch scripts."""

    url = ""
    namespace = ""

    def _build(self) -> LeaseChecker:
        import redis

        from msgpatterns.idempotency import RedisChecker

        # the same keys for both twins (keys show in claims, errors and logs), each in a
        # database of its own
        client = redis.Redis.from_url(self.url, db=6 if self.plain else 5)
        checker = RedisChecker(client, namespace=self.namespace,
                               ttl=TTL, lease=LEASE, policy=self._policy(),
                               write_behind=LEASE - 1 if self.schedule.write_behind else None)
        scripts = checker.store.scripts
        by_sha = {}
        for script, op in ((scripts.claim, "claim_many"), (scripts.complete, "complete_many"),
                           (scripts.release, "release_many")):
            by_sha[script.sha] = op
            if script.one is not None:
                by_sha[script.one.sha] = op
                if self.plain:
                    script.one = None  # the batch scripts, even for one key
        link = checker.store.link
        send = link.call

        def call(*args: Any) -> Any:
            if args[0] != "EVALSHA":
                return send(*args)
            self.journal.attempt(by_sha[args[1]], int(args[2]))
            try:
                return send(*args)
            except redis.exceptions.NoScriptError:
                # the server's script cache was empty (a restart or SCRIPT FLUSH by
                # another test): the store loads the script and sends the call again,
                # on either path; that is not a round trip of the path under test
                self.journal.trips.pop()
                raise

        send_script = link.script

        def script(command: Any, rest: tuple[Any, ...]) -> Any:
            # the single-key forms' calls (EVALSHA <sha> 1 packed once)
            self.journal.attempt(by_sha[command.words[1]], command.words[2])
            try:
                return send_script(command, rest)
            except redis.exceptions.NoScriptError:
                self.journal.trips.pop()  # as for call() above
                raise

        link.call = call  # type: ignore[method-assign]
        link.script = script  # type: ignore[method-assign]
        self.client = checker.client
        return checker

    def _delay(self, exc: BaseException) -> Any:
        return None  # the lease left is measured by the server's clock

    def _text(self, exc: BaseException) -> str:
        return re.sub(r"retry in [0-9.]+s", "retry in ?s", str(exc))

    def _claim(self, claim: Any) -> Any:
        return claim._replace(remaining=0.0)

    def _expire_leases(self, index: int) -> None:
        for key in self.client.scan_iter(f"{self.namespace}:*"):
            if (self.client.get(key) or b"").startswith(b"P"):
                self.client.delete(key)

    def _expire_all(self, index: int) -> None:
        for key in self.client.scan_iter(f"{self.namespace}:*"):
            self.client.delete(key)

    def records(self) -> Any:
        prefix = len(self.namespace) + 1
        return {key[prefix:]: self.client.get(key)
                for key in self.client.scan_iter(f"{self.namespace}:*")}

    def close(self) -> None:
        super().close()
        self._expire_all(0)
        self.client.close()


@pytest.mark.redis
def test_the_hot_path_and_its_plain_twin_agree_on_redis(redis_url: str) -> None:
    RedisTwin.url = redis_url

    @settings(max_examples=examples(0.5), deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(schedules)
    def agree(schedule: Schedule) -> None:
        RedisTwin.namespace = f"diff-{uuid.uuid4().hex[:12]}"
        check_twins(schedule, RedisTwin(False, schedule), RedisTwin(True, schedule))

    agree()
