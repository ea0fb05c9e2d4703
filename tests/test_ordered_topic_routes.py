"""Ordered topics: the route model and the route stores (one conformance suite)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from msgpatterns.ordering import (
    MemoryRouteStore,
    RedisRouteStore,
    Route,
    RouteError,
    RouteStore,
    SqlRouteStore,
    logic_partition,
)
from msgpatterns.ordering.routes import check_successor, initial_route
from msgpatterns.testing import services

# -- the route model -------------------------------------------------------------------

changes = st.lists(st.tuples(st.sampled_from(["split", "merge", "move"]),
                             st.integers(0, 10_000), st.integers(0, 10_000)),
                   max_size=30)


def apply(route: Route, change: tuple[str, int, int]) -> Route | None:
    """Apply a generated change if it is possible on ``route`` (None when it is not)."""
    kind, a, b = change
    segments = route.segments
    if kind == "split":
        seg = segments[a % len(segments)]
        if seg.stop - seg.start < 2:
            return None
        return route.split(seg.physical, seg.start + 1 + b % (seg.stop - seg.start - 1))
    if kind == "merge":
        if len(segments) < 2:
            return None
        i = a % (len(segments) - 1)
        return route.merge(segments[i + 1].physical, segments[i].physical)
    return route.move(segments[a % len(segments)].physical)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.sampled_from([8, 64, 1024]), changes)
def test_every_change_is_one_valid_successor(physical: int, logic: int,
                                             steps: list[tuple[str, int, int]]) -> None:
    route = initial_route(physical, max(logic, physical))
    ids_seen = set(route.physicals)
    for step in steps:
        new = apply(route, step)
        if new is None:
            continue
        check_successor(route, new)
        assert not ids_seen & set(new.opened), "a physical id is never reused"
        ids_seen |= set(new.opened)
        table = new.table()
        assert len(table) == new.logic_partitions
        for lp in range(0, new.logic_partitions, 7):
            assert new.physical_of(lp) == table[lp]
        # only the changed ranges move
        old_table = route.table()
        for lp, (before, after) in enumerate(zip(old_table, table, strict=True)):
            assert (before == after) == (before not in new.closed), lp
        assert Route.from_json(new.to_json()) == new
        route = new


def test_changes_that_break_the_rules_are_refused() -> None:
    route = initial_route(3, 12)  # 0:[0,4) 1:[4,8) 2:[8,12)
    with pytest.raises(RouteError, match="adjacent"):
        route.merge(0, 2)
    with pytest.raises(RouteError, match="not open"):
        route.split(7)
    with pytest.raises(RouteError, match="strictly inside"):
        route.split(1, at=8)
    with pytest.raises(RouteError, match="contiguous"):
        check_successor(route, route.split(0).split(4))
    moved = route.move(1)
    with pytest.raises(RouteError, match="not open"):
        moved.split(1)
    with pytest.raises(RouteError, match="one logic partition"):
        initial_route(2, 2).split(0)
    with pytest.raises(RouteError):
        Route.from_json('{"version": 1}')


def test_the_logic_partition_is_the_ordered_executors() -> None:
    route = initial_route(4, 1024)
    for key in ("order-1", "order-2", b"\xff", 42):
        assert route.physical_of(logic_partition(key, 1024)) in route.physicals


# -- the stores ------------------------------------------------------------------------


@pytest.fixture(params=[
    "memory", "sqlite",
    pytest.param("postgres", marks=pytest.mark.postgres),
    pytest.param("mysql", marks=pytest.mark.mysql),
    "fakeredis", "redis",
])
def store(request: pytest.FixtureRequest, tmp_path: Any, unique: str) -> Iterator[RouteStore]:
    kind = request.param
    made: Any
    if kind == "memory":
        made = MemoryRouteStore()
    elif kind == "sqlite":
        made = SqlRouteStore(f"sqlite:///{tmp_path / 'routes.db'}", prefix=f"r{unique}")
    elif kind in ("postgres", "mysql"):
        made = SqlRouteStore(services.require(kind), prefix=f"r{unique}")
    elif kind == "fakeredis":
        made = RedisRouteStore(fakeredis.FakeRedis(), prefix=f"r{unique}")
    else:
        made = RedisRouteStore(services.require("redis"), prefix=f"r{unique}")
    yield made
    if isinstance(made, SqlRouteStore):
        for table in made._tables:
            table.drop(made.engine, checkfirst=True)
    if isinstance(made, RedisRouteStore):
        for key in made.client.scan_iter(f"r{unique}:*"):
            made.client.delete(key)
    made.close()


def test_store_create_is_idempotent_and_history_grows_by_commits(store: RouteStore) -> None:
    assert store.state("t") is None and store.history("t") == []
    v1 = initial_route(2, 64)
    assert store.create("t", v1) == v1
    assert store.create("t", initial_route(5, 64)) == v1  # exists: left as it is
    v2 = v1.split(1)
    assert store.propose("t", v2)
    state = store.state("t")
    assert state is not None and state.committed == v1 and state.pending == v2
    assert state.publishing == v2
    assert not store.propose("t", v1.move(0)), "one change at a time"
    assert not store.commit("t", 3)
    assert store.commit("t", 2)
    assert not store.commit("t", 2)
    assert store.history("t") == [v1, v2]
    state = store.state("t")
    assert state is not None and state.committed == v2 and state.pending is None
    assert not store.propose("t", v1.move(0)), "versions are contiguous"
    assert not store.propose("t", v2.split(3).split(5)), "a version skipped"
    forged = Route(3, 64, v2.segments, "move", (99,), (100,), 101)
    with pytest.raises(RouteError):
        store.propose("t", forged)


def test_store_propose_has_one_winner_among_racers(store: RouteStore) -> None:
    v1 = store.create("race", initial_route(4, 64))
    candidates = [v1.split(p) for p in v1.physicals] + [v1.move(p) for p in v1.physicals]
    wins: list[Route] = []
    barrier = threading.Barrier(len(candidates))

    def go(route: Route) -> None:
        barrier.wait()
        if store.propose("race", route):
            wins.append(route)

    threads = [threading.Thread(target=go, args=(r,)) for r in candidates]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(wins) == 1
    state = store.state("race")
    assert state is not None and state.pending == wins[0]


def test_store_leases_have_one_owner_until_released_or_expired(store: RouteStore) -> None:
    assert store.lease("t", "g", 3, "a", now=100.0, ttl=10.0)
    assert not store.lease("t", "g", 3, "b", now=105.0, ttl=10.0)
    assert store.lease("t", "g", 3, "a", now=105.0, ttl=10.0), "renewal"
    assert store.leases("t", "g", now=114.0) == {3: "a"}
    assert store.expired_leases("t", "g", now=114.0) == {}
    assert store.expired_leases("t", "g", now=115.0) == {3: "a"}, "a died: expired"
    assert store.lease("t", "g", 3, "b", now=115.5, ttl=10.0), "expired: taken over"
    assert store.leases("t", "g", now=116.0) == {3: "b"}
    store.release("t", "g", 3, "a")  # not the owner: nothing
    assert store.leases("t", "g", now=116.0) == {3: "b"}
    store.release("t", "g", 3, "b")
    assert store.leases("t", "g", now=116.0) == {}
    assert store.lease("t", "other", 3, "a", now=116.0, ttl=1.0), "groups are separate"
    weird = "own|er\n{x}"
    assert store.lease("t", "g", 4, weird, now=1.0, ttl=10.0)
    assert store.leases("t", "g", now=2.0) == {4: weird}


def test_store_members_and_commands(store: RouteStore) -> None:
    store.heartbeat("t", "g", "b", now=10.0, ttl=5.0)
    store.heartbeat("t", "g", "a", now=10.0, ttl=5.0)
    store.heartbeat("t", "g", "c", now=10.0, ttl=1.0)
    assert store.members("t", "g", now=12.0) == ["a", "b"]
    store.leave("t", "g", "a")
    assert store.members("t", "g", now=12.0) == ["b"]
    store.record_command("t", "g", 2, 1)
    store.record_command("t", "g", 2, 1)
    store.record_command("t", "g", 3, 4)
    assert store.commands("t", "g") == {(2, 1), (3, 4)}
    assert store.commands("t", "h") == frozenset()


def test_store_repr_hides_the_password() -> None:
    store = SqlRouteStore("postgresql+psycopg://u:s3cret@127.0.0.1:1/x")
    assert "s3cret" not in repr(store)
    rstore = RedisRouteStore("redis://:s3cret@127.0.0.1:1/0")
    assert "s3cret" not in repr(rstore)
