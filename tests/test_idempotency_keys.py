"""Keys are data: any text, any length, stored without truncation and without collisions."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from msgpatterns.errors import ConfigurationError
from msgpatterns.idempotency import KeyBuilder, LeaseChecker, Status
from msgpatterns.testing.checker_fixtures import STORES, checker_for, store_params

NASTY_KEYS = [
    "a", "A", "a ", " a", "a\t", "a\n",
    "it's", 'say "hi"', "back\\slash", "%", "_", "a%b_c",
    "*", "key*", "[a-z]?", "a:b", ":", "::", "a:b:c",
    "{tag}", "{", "}", "{user1000}.following",
    "k e y", "ключ", "鍵", "🔑", "é", "e\u0301",
    "'; DROP TABLE msgpatterns_dedup; --", "KEYS *", "a\x00b", "a\x00c", "\ud800",
    "x" * 10_000, "x" * 9_999 + "y",
    "p" * 200 + "1", "p" * 200 + "2", "p" * 200,
    "sha256:" + hashlib.sha256(b"x" * 10_000).hexdigest(),
]

ALL_STORES = store_params(*STORES)


# -- the key builder ----------------------------------------------------------------------

def test_short_keys_are_stored_verbatim_under_namespace_and_group() -> None:
    keys = KeyBuilder("ns", 255)
    assert keys.build("order-1", "billing") == "ns:billing:order-1"
    assert keys.build(42, "g") == "ns:g:42"
    assert keys.build(b"order-1", "billing") == "ns:billing:order-1"
    assert keys.build(uuid.UUID(int=1)) == "ns::00000000-0000-0000-0000-000000000001"


def test_long_keys_are_hashed_never_truncated() -> None:
    keys = KeyBuilder("ns", 255)
    long_key = "x" * 10_000
    stored = keys.build(long_key, "g")
    assert stored == "ns:g:sha256:" + hashlib.sha256(long_key.encode()).hexdigest()
    assert keys.build("x" * 9_999 + "y", "g") != stored
    assert keys.build("é" * 125, "g") == "ns:g:" + "é" * 125  # 5 + 250 bytes: fits
    assert keys.build("é" * 126, "g").startswith("ns:g:sha256:")  # 5 + 252: hashed


def test_a_key_that_looks_like_a_digest_cannot_impersonate_one() -> None:
    keys = KeyBuilder("ns", 255)
    hashed = keys.build("x" * 10_000, "g")
    spoof = hashed.removeprefix("ns:g:")
    assert keys.build(spoof, "g") != hashed


def test_bytes_that_are_not_utf8_are_hashed() -> None:
    keys = KeyBuilder("ns", None)
    assert keys.build(b"\xff\xfe", "g") == "ns:g:sha256:" + hashlib.sha256(b"\xff\xfe").hexdigest()


@pytest.mark.parametrize("bad", [None, "", b""])
def test_missing_or_empty_keys_are_refused(bad: object) -> None:
    with pytest.raises(ValueError, match=r"None|empty"):
        KeyBuilder("ns", None).build(bad)


def test_keys_of_other_types_are_refused() -> None:
    with pytest.raises(TypeError, match="must be str, bytes or int"):
        KeyBuilder("ns", None).build(1.5)


def test_namespace_and_group_cannot_hold_the_separator() -> None:
    with pytest.raises(ConfigurationError, match="namespace"):
        KeyBuilder("a:b", None)
    with pytest.raises(ConfigurationError, match="group"):
        KeyBuilder("ns", None).build("k", "a:b")


def test_a_prefix_too_long_for_the_store_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="no room"):
        KeyBuilder("ns", 255).build("k", "g" * 200)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.text(min_size=1), st.binary(min_size=1)), min_size=2,
                max_size=8, unique=True),
       st.sampled_from([None, 90, 255]))
def test_distinct_keys_never_collide_and_always_fit(keys: list[str | bytes],
                                                    limit: int | None) -> None:
    builder = KeyBuilder("ns", limit)
    # bytes that decode as UTF-8 are the same key as their text
    canonical = {k.decode("utf-8", "surrogateescape") if isinstance(k, bytes) else k
                 for k in keys}
    built = {builder.build(key, "g") for key in keys}
    assert len(built) == len(canonical)
    if limit is not None:
        assert all(len(key.encode("utf-8")) <= limit for key in built)


# -- every store ----------------------------------------------------------------------------

@pytest.fixture(params=ALL_STORES)
def checker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LeaseChecker]:
    with checker_for(request.param, tmp_path) as built:
        assert isinstance(built, LeaseChecker)
        yield built


def test_nasty_keys_work_and_never_collide_in_the_store(checker: LeaseChecker) -> None:
    stored = [checker.store_key(key, "g") for key in NASTY_KEYS]
    assert len(set(stored)) == len(NASTY_KEYS)
    claims = [checker.claim(key, group="g") for key in NASTY_KEYS]
    assert [c.status for c in claims] == [Status.CLAIMED] * len(NASTY_KEYS)
    # each key finds its own record again, and only its own
    again = checker.claim_many(NASTY_KEYS, group="g")
    assert [c.status for c in again] == [Status.IN_PROGRESS] * len(NASTY_KEYS)
    assert checker.complete_many(claims) == [True] * len(NASTY_KEYS)
    assert all(c.status is Status.DONE for c in checker.claim_many(NASTY_KEYS, group="g"))


def test_nasty_keys_in_one_batch(checker: LeaseChecker) -> None:
    claims = checker.claim_many(NASTY_KEYS, group="batch")
    assert all(c.claimed for c in claims)
    assert checker.complete_many(claims) == [True] * len(NASTY_KEYS)
    assert checker.release_many(claims) == [False] * len(NASTY_KEYS)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.text(min_size=1, max_size=300), min_size=1, max_size=20, unique=True))
def test_random_text_keys_round_trip_through_the_store(checker: LeaseChecker,
                                                       keys: list[str]) -> None:
    group = uuid.uuid4().hex  # a fresh group per example
    claims = checker.claim_many(keys, group=group)
    assert all(c.claimed for c in claims)
    assert [c.status for c in checker.claim_many(keys, group=group)] == \
        [Status.IN_PROGRESS] * len(keys)
