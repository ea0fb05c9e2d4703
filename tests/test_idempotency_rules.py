"""The six idempotency rules, on every lease-based store.

Always: MemoryChecker, RedisChecker on fakeredis, SqlChecker on SQLite. With the
markers: the real Redis, PostgreSQL and MariaDB of this machine.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from msgpatterns.errors import InProgress
from msgpatterns.idempotency import LeaseChecker, Status
from msgpatterns.testing.checker_fixtures import STORES, FakeClock, checker_for, store_params

LEASE_STORES = store_params(*STORES)


@dataclass
class Store:
    """A checker and a way to let time pass beyond its leases (and ttls)."""

    checker: LeaseChecker
    clock: FakeClock | None

    def elapse(self, seconds: float) -> None:
        if self.clock is not None:
            self.clock.advance(seconds)
        else:  # Redis keeps time itself: short leases, real waiting
            time.sleep(seconds)


@pytest.fixture(params=LEASE_STORES)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    kind: str = request.param
    redis = kind in ("fakeredis", "redis")
    clock = None if redis else FakeClock()
    # Redis keeps real time: a lease long enough that a loaded machine does not outlive
    # it between two calls (0.3 s did, once).
    options: dict[str, Any] = {"lease": 1.0, "ttl": 2.0} if redis else \
        {"lease": 30, "ttl": 600, "clock": clock}
    with checker_for(kind, tmp_path, **options) as checker:
        assert isinstance(checker, LeaseChecker)
        yield Store(checker, clock)


def lease_of(store: Store) -> float:
    return store.checker.lease


# -- rule 1: claim ------------------------------------------------------------------------

def test_claim_takes_an_absent_key_and_reports_a_live_one_in_progress(store: Store) -> None:
    checker = store.checker
    first = checker.claim("order-1", group="g")
    again = checker.claim("order-1", group="g")
    assert first.status is Status.CLAIMED and first.token
    assert again.status is Status.IN_PROGRESS and again.token is None
    assert 0 < again.remaining <= checker.lease
    assert checker.claim("order-1", group="other").status is Status.CLAIMED  # groups apart


def test_claim_takes_over_a_lease_that_expired(store: Store) -> None:
    checker = store.checker
    dead = checker.claim("k")
    store.elapse(lease_of(store) + 0.05)
    heir = checker.claim("k")
    assert heir.status is Status.CLAIMED and heir.token != dead.token


# -- rule 2: complete by compare-and-set on the token ---------------------------------------

def test_complete_makes_the_key_done_and_is_safe_to_repeat(store: Store) -> None:
    checker = store.checker
    claim = checker.claim("k")
    assert checker.complete(claim) is True
    assert checker.complete(claim) is True  # a retried complete (lost reply) still succeeds
    assert checker.claim("k").status is Status.DONE
    assert checker.stats.completed == 2 and checker.stats.duplicates == 1


def test_complete_after_losing_the_lease_does_not_overwrite_the_new_owner(
    store: Store, caplog: pytest.LogCaptureFixture,
) -> None:
    checker = store.checker
    old = checker.claim("k")
    store.elapse(lease_of(store) + 0.05)
    new = checker.claim("k")
    assert new.claimed
    assert checker.complete(old) is False
    assert checker.stats.lost_leases == 1
    assert "expired before completion" in caplog.text
    assert checker.claim("k").status is Status.IN_PROGRESS  # still the new owner's
    assert checker.complete(new) is True
    assert checker.claim("k").status is Status.DONE


# -- rule 3: release by compare-and-delete --------------------------------------------------

def test_release_frees_the_key_for_the_next_claim(store: Store) -> None:
    checker = store.checker
    claim = checker.claim("k")
    assert checker.release(claim) is True
    assert checker.release(claim) is False  # nothing left to release
    assert checker.claim("k").status is Status.CLAIMED


def test_release_with_a_stale_token_leaves_the_new_owner_alone(store: Store) -> None:
    checker = store.checker
    old = checker.claim("k")
    store.elapse(lease_of(store) + 0.05)
    new = checker.claim("k")
    assert checker.release(old) is False
    assert checker.claim("k").status is Status.IN_PROGRESS
    assert checker.complete(new) is True


def test_release_never_deletes_a_done_key(store: Store) -> None:
    checker = store.checker
    claim = checker.claim("k")
    checker.complete(claim)
    assert checker.release(claim) is False
    assert checker.claim("k").status is Status.DONE


def test_a_failing_call_releases_its_claim_and_the_error_propagates(store: Store) -> None:
    checker = store.checker
    runs = []

    def boom(_: object) -> None:
        runs.append(1)
        raise ValueError("handler failed")

    with pytest.raises(ValueError, match="handler failed"):
        checker.execute("k", boom)
    assert checker.claim("k").status is Status.CLAIMED  # free again, not stuck
    assert runs == [1] and checker.stats.released == 1


# -- rule 4: DONE is skipped ----------------------------------------------------------------

def test_execute_runs_once_and_skips_the_duplicate(store: Store) -> None:
    checker = store.checker
    runs: list[str] = []

    def handler(name: str) -> Any:
        def call(tx: object) -> str:
            runs.append(name)
            return "result"
        return call

    first = checker.execute("k", handler("ran"))
    second = checker.execute("k", handler("again"))
    assert (first.ran, first.result) == (True, "result")
    assert (second.ran, second.result) == (False, None)
    assert runs == ["ran"]


def test_done_is_forgotten_after_the_ttl(store: Store) -> None:
    checker = store.checker
    checker.execute("k", lambda _: None)
    store.elapse(checker.ttl + 0.05)
    assert checker.claim("k").status is Status.CLAIMED


# -- rule 5: a live owner means InProgress -----------------------------------------------------

def test_execute_raises_in_progress_with_the_remaining_lease(store: Store) -> None:
    checker = store.checker
    checker.claim("k")
    with pytest.raises(InProgress) as caught:
        checker.execute("k", lambda _: pytest.fail("ran while another owner holds the key"))
    assert caught.value.delay is not None
    assert 0 < caught.value.delay <= checker.lease


# -- batch calls ------------------------------------------------------------------------------

def test_claim_many_and_complete_many(store: Store) -> None:
    checker = store.checker
    done = checker.claim("done")
    checker.complete(done)
    busy = checker.claim("busy")
    keys = ["done", "busy", *[f"new-{i}" for i in range(100)], "new-7"]
    claims = checker.claim_many(keys)
    assert [c.status for c in claims[:2]] == [Status.DONE, Status.IN_PROGRESS]
    assert all(c.status is Status.CLAIMED for c in claims[2:102])
    assert claims[102].status is Status.IN_PROGRESS  # repeat of new-7 within the batch
    assert len({c.token for c in claims[2:102]}) == 100
    assert checker.complete_many([c for c in claims if c.claimed]) == [True] * 100
    again = checker.claim_many(keys)
    assert [c.status for c in again] == [Status.DONE, Status.IN_PROGRESS] + [Status.DONE] * 101
    assert checker.release_many([busy]) == [True]
    with pytest.raises(ValueError, match="not claimed"):
        checker.complete_many(again)


def test_complete_many_reports_each_lost_lease(store: Store) -> None:
    checker = store.checker
    claims = checker.claim_many(["a", "b", "c"])
    store.elapse(lease_of(store) + 0.05)
    taken = checker.claim("b")
    assert taken.claimed
    # a and c: expired but nobody took them, so completing them is still safe
    assert checker.complete_many(claims) == [True, False, True]
    assert checker.stats.lost_leases == 1
    assert [c.status for c in checker.claim_many(["a", "b", "c"])] == \
        [Status.DONE, Status.IN_PROGRESS, Status.DONE]


def test_complete_after_the_record_was_purged_still_records_done(store: Store) -> None:
    checker = store.checker
    claim = checker.claim("slow")
    store.elapse(lease_of(store) + 0.05)
    checker.purge()  # the expired lease is gone (Redis drops it by itself)
    assert checker.complete(claim) is True
    assert checker.claim("slow").status is Status.DONE


def test_release_many_reports_which_keys_it_freed(store: Store) -> None:
    checker = store.checker
    claims = checker.claim_many(["a", "b", "c"])
    checker.complete(claims[1])
    assert checker.release_many(claims) == [True, False, True]
    assert [c.status for c in checker.claim_many(["a", "b", "c"])] == \
        [Status.CLAIMED, Status.DONE, Status.CLAIMED]


def test_empty_batches_do_nothing(store: Store) -> None:
    assert store.checker.claim_many([]) == []
    assert store.checker.complete_many([]) == []


# -- purge -------------------------------------------------------------------------------------

def test_purge_removes_only_expired_records(store: Store) -> None:
    checker = store.checker
    checker.complete(checker.claim("old"))
    store.elapse(checker.ttl + 0.05)
    live = checker.claim("live")
    checker.complete(checker.claim("fresh"))
    purged = checker.purge()
    assert purged == (0 if store.clock is None else 1)  # Redis expires keys itself
    assert checker.claim("live").status is Status.IN_PROGRESS
    assert checker.claim("fresh").status is Status.DONE
    assert checker.claim("old").status is Status.CLAIMED
    assert live.claimed
