"""An ordered topic that is split, merged and moved while it is consumed.

Account events (``deposit``/``withdraw`` with a per-account sequence number) are
published under the account id. Three consumers (think: three processes) share the
topic's physical partitions through leases in the route store. Half-way through, an
operator splits a partition (more consumers can help), later merges two back and
moves one (say, off a full server). Every account's events are still applied in the
order they were published, none lost, none twice: the script checks it and prints
the route history, as ``msgpatterns topic show`` does.

Embedded defaults: the in-memory broker and the routes in SQLite (a temporary file).
With real servers, change the broker and the store; nothing else:

    broker = RedisStreamsBroker("redis://localhost:6379/0")
    routes = RedisRouteStore("redis://localhost:6379/0")        # or SqlRouteStore(url)

    python examples/ordered_topic.py
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from msgpatterns import InMemoryBroker, Message
from msgpatterns.ordering import OrderedTopic, SqlRouteStore

ACCOUNTS = [f"acct-{i:03d}" for i in range(40)]
EVENTS = 1200


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run(SqlRouteStore(f"sqlite:///{Path(tmp) / 'routes.db'}"))


def run(routes: SqlRouteStore) -> None:
    broker = InMemoryBroker(record_history=False)
    # Short fence and route cache: one process, no network. The defaults (fence=1 s,
    # route_cache=0.25 s) leave room for slow publishers on real networks.
    options = {"routes": routes, "route_cache": 0.02, "fence": 0.05}
    publisher = OrderedTopic(broker, "accounts", **options)
    publisher.create(physical=2)

    applied: dict[str, list[int]] = defaultdict(list)
    lock = threading.Lock()

    def apply(message: Message) -> None:
        event = message.body
        time.sleep(0.0005)  # the database write
        with lock:
            applied[event["account"]].append(event["seq"])

    consumers = []
    for name in ("consumer-a", "consumer-b", "consumer-c"):
        topic = OrderedTopic(broker, "accounts", **options)
        consumer = topic.consumer(apply, group="ledger", owner=name, refresh=0.05,
                                  poll_timeout=0.02)
        consumer.start()
        consumers.append(consumer)

    rng = random.Random(7)
    sequence: dict[str, int] = defaultdict(int)
    changes = {EVENTS // 4: ("split", 1), EVENTS // 2: ("merge", 2, 3),
               3 * EVENTS // 4: ("move", 0)}
    for i in range(EVENTS):
        if i in changes:
            kind, *partitions = changes[i]
            route = getattr(publisher, kind)(*partitions)
            print(f"operator: {route.describe()}")
        account = rng.choice(ACCOUNTS)
        sequence[account] += 1
        kind = rng.choice(["deposit", "withdraw"])
        publisher.publish(account, {"account": account, "seq": sequence[account],
                                    "kind": kind, "amount": rng.randint(1, 100)})

    deadline = time.monotonic() + 120
    while sum(map(len, applied.values())) < EVENTS and time.monotonic() < deadline:
        time.sleep(0.02)
    for consumer in consumers:
        consumer.stop(10)
        consumer.broker.close()  # the consumer's feed: hands its leases back

    print("\nversion  change  closed -> opened  partitions (physical:[logic range))")
    for route in publisher.routes():
        closed = ",".join(map(str, route.closed)) or "-"
        opened = ",".join(map(str, route.opened))
        ranges = "  ".join(f"{s.physical}:[{s.start},{s.stop})" for s in route.segments)
        print(f"{route.version:<8} {route.kind:<7} {closed + ' -> ' + opened:<17} {ranges}")

    in_order = all(applied[a] == list(range(1, sequence[a] + 1)) for a in sequence)
    total = sum(map(len, applied.values()))
    print(f"\n{total} of {EVENTS} events applied; every account in publish order: "
          f"{in_order}")
    routes.close()
    if not in_order or total != EVENTS:
        raise SystemExit("per-key order broken or events lost")


if __name__ == "__main__":
    main()
