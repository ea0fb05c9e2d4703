"""SqlRouteStore: an ordered topic's routes, leases and command records in SQL.

Five small tables (created on first use, safe to race): the topic row (committed
version and the pending change), the route history, the recorded command messages,
the partition leases and the group members. Every change of version is an optimistic
``UPDATE ... WHERE version = :v`` (the QMQ design), so one change wins per version;
leases change owner with a conditional ``UPDATE ... WHERE owner = :me OR expires <
:now``. PostgreSQL, MySQL/MariaDB and SQLite.

Needs the ``[sql]`` extra (SQLAlchemy).
"""

from __future__ import annotations

from typing import Any

from msgpatterns._extras import require

require("sqlalchemy", "sql")

import sqlalchemy as sa  # noqa: E402
from sqlalchemy.engine import Engine  # noqa: E402

from msgpatterns._sql import OnFirstUse, create_table, insert_if_absent  # noqa: E402
from msgpatterns.ordering.route_store import TopicState, may_propose  # noqa: E402
from msgpatterns.ordering.routes import Route  # noqa: E402

__all__ = ["SqlRouteStore"]

_NAME = 200  # topic, group and owner lengths


class SqlRouteStore:
    """A :class:`~msgpatterns.ordering.RouteStore` on a SQL database.

    Args:
        engine_or_url: a SQLAlchemy ``Engine`` or a database URL (the store then owns
            the engine and disposes of it on :meth:`close`).
        prefix: the tables' name prefix (``msgpatterns_route`` by default).
    """

    def __init__(self, engine_or_url: Engine | str, *, prefix: str = "msgpatterns_route"
                 ) -> None:
        self._owns = isinstance(engine_or_url, str)
        self.engine: Engine = (sa.create_engine(engine_or_url)
                               if isinstance(engine_or_url, str) else engine_or_url)
        meta = sa.MetaData()
        text = sa.String(_NAME)
        self.topics = sa.Table(
            f"{prefix}_topics", meta,
            sa.Column("topic", text, primary_key=True),
            sa.Column("version", sa.Integer, nullable=False),
            sa.Column("pending_version", sa.Integer, nullable=True),
            sa.Column("pending", sa.Text, nullable=True))
        self.routes = sa.Table(
            f"{prefix}_history", meta,
            sa.Column("topic", text, primary_key=True),
            sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("route", sa.Text, nullable=False))
        self.commands_table = sa.Table(
            f"{prefix}_commands", meta,
            sa.Column("topic", text, primary_key=True),
            sa.Column("grp", text, primary_key=True),
            sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("physical", sa.Integer, primary_key=True, autoincrement=False))
        self.leases_table = sa.Table(
            f"{prefix}_leases", meta,
            sa.Column("topic", text, primary_key=True),
            sa.Column("grp", text, primary_key=True),
            sa.Column("physical", sa.Integer, primary_key=True, autoincrement=False),
            sa.Column("owner", text, nullable=False),
            sa.Column("expires", sa.Float, nullable=False))
        self.members_table = sa.Table(
            f"{prefix}_members", meta,
            sa.Column("topic", text, primary_key=True),
            sa.Column("grp", text, primary_key=True),
            sa.Column("owner", text, primary_key=True),
            sa.Column("expires", sa.Float, nullable=False))
        self._tables = (self.topics, self.routes, self.commands_table, self.leases_table,
                        self.members_table)
        self._ready = OnFirstUse(self._create_tables)

    def _create_tables(self) -> None:
        for table in self._tables:
            create_table(self.engine, table)

    # -- routes ---------------------------------------------------------------------

    def create(self, topic: str, route: Route) -> Route:
        self._ready()
        with self.engine.begin() as conn:
            if insert_if_absent(conn, self.topics, [self.topics.c.topic],
                                {"topic": topic, "version": route.version}):
                conn.execute(sa.insert(self.routes).values(
                    topic=topic, version=route.version, route=route.to_json()))
                return route
        state = self.state(topic)
        assert state is not None
        return state.committed

    def state(self, topic: str) -> TopicState | None:
        self._ready()
        t, r = self.topics, self.routes
        query = (sa.select(r.c.route, t.c.pending)
                 .select_from(t.join(r, sa.and_(r.c.topic == t.c.topic,
                                                r.c.version == t.c.version)))
                 .where(t.c.topic == topic))
        with self.engine.connect() as conn:
            row = conn.execute(query).first()
        if row is None:
            return None
        pending = Route.from_json(row.pending) if row.pending is not None else None
        return TopicState(Route.from_json(row.route), pending)

    def history(self, topic: str) -> list[Route]:
        self._ready()
        query = (sa.select(self.routes.c.route).where(self.routes.c.topic == topic)
                 .order_by(self.routes.c.version))
        with self.engine.connect() as conn:
            return [Route.from_json(text) for (text,) in conn.execute(query)]

    def propose(self, topic: str, route: Route) -> bool:
        if not may_propose(self.state(topic), route):
            return False
        t = self.topics
        with self.engine.begin() as conn:
            done = conn.execute(
                sa.update(t).where(t.c.topic == topic, t.c.version == route.version - 1,
                                   t.c.pending_version.is_(None))
                .values(pending_version=route.version, pending=route.to_json())
                .execution_options(preserve_rowcount=True))
            return done.rowcount == 1

    def commit(self, topic: str, version: int) -> bool:
        t = self.topics
        with self.engine.begin() as conn:
            row = conn.execute(sa.select(t.c.pending).where(
                t.c.topic == topic, t.c.pending_version == version).with_for_update()
            ).first()
            if row is None:
                return False
            done = conn.execute(
                sa.update(t).where(t.c.topic == topic, t.c.pending_version == version)
                .values(version=version, pending_version=None, pending=None)
                .execution_options(preserve_rowcount=True))
            if done.rowcount != 1:
                return False
            conn.execute(sa.insert(self.routes).values(topic=topic, version=version,
                                                       route=row.pending))
            return True

    # -- consumers ------------------------------------------------------------------

    def record_command(self, topic: str, group: str, version: int, physical: int) -> None:
        self._ready()
        c = self.commands_table
        with self.engine.begin() as conn:
            insert_if_absent(conn, c, [c.c.topic, c.c.grp, c.c.version, c.c.physical],
                             {"topic": topic, "grp": group, "version": version,
                              "physical": physical})

    def commands(self, topic: str, group: str) -> frozenset[tuple[int, int]]:
        self._ready()
        c = self.commands_table
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(c.c.version, c.c.physical).where(
                c.c.topic == topic, c.c.grp == group))
            return frozenset((int(v), int(p)) for v, p in rows)

    def lease(self, topic: str, group: str, physical: int, owner: str, now: float,
              ttl: float) -> bool:
        self._ready()
        lt = self.leases_table
        key = {"topic": topic, "grp": group, "physical": physical}
        with self.engine.begin() as conn:
            if insert_if_absent(conn, lt, [lt.c.topic, lt.c.grp, lt.c.physical],
                                {**key, "owner": owner, "expires": now + ttl}):
                return True
            done = conn.execute(
                sa.update(lt).where(lt.c.topic == topic, lt.c.grp == group,
                                    lt.c.physical == physical,
                                    sa.or_(lt.c.owner == owner, lt.c.expires <= now))
                .values(owner=owner, expires=now + ttl)
                .execution_options(preserve_rowcount=True))
            return done.rowcount == 1

    def release(self, topic: str, group: str, physical: int, owner: str) -> None:
        self._ready()
        lt = self.leases_table
        with self.engine.begin() as conn:
            conn.execute(sa.delete(lt).where(lt.c.topic == topic, lt.c.grp == group,
                                             lt.c.physical == physical, lt.c.owner == owner))

    def leases(self, topic: str, group: str, now: float) -> dict[int, str]:
        self._ready()
        lt = self.leases_table
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(lt.c.physical, lt.c.owner).where(
                lt.c.topic == topic, lt.c.grp == group, lt.c.expires > now))
            return {int(p): str(o) for p, o in rows}

    def expired_leases(self, topic: str, group: str, now: float) -> dict[int, str]:
        self._ready()
        lt = self.leases_table
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(lt.c.physical, lt.c.owner).where(
                lt.c.topic == topic, lt.c.grp == group, lt.c.expires <= now))
            return {int(p): str(o) for p, o in rows}

    def heartbeat(self, topic: str, group: str, owner: str, now: float, ttl: float) -> None:
        self._ready()
        m = self.members_table
        row: dict[str, Any] = {"topic": topic, "grp": group, "owner": owner,
                               "expires": now + ttl}
        with self.engine.begin() as conn:
            if not insert_if_absent(conn, m, [m.c.topic, m.c.grp, m.c.owner], row):
                conn.execute(sa.update(m).where(
                    m.c.topic == topic, m.c.grp == group, m.c.owner == owner)
                    .values(expires=now + ttl))

    def leave(self, topic: str, group: str, owner: str) -> None:
        self._ready()
        m = self.members_table
        with self.engine.begin() as conn:
            conn.execute(sa.delete(m).where(m.c.topic == topic, m.c.grp == group,
                                            m.c.owner == owner))

    def members(self, topic: str, group: str, now: float) -> list[str]:
        self._ready()
        m = self.members_table
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(m.c.owner).where(
                m.c.topic == topic, m.c.grp == group, m.c.expires > now))
            return sorted(str(o) for (o,) in rows)

    def close(self) -> None:
        """Dispose of the engine when the store built it from a URL."""
        if self._owns:
            self.engine.dispose()

    def __repr__(self) -> str:
        return f"SqlRouteStore({self.engine.url.render_as_string(hide_password=True)!r})"
