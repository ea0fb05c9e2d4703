"""Ordered topics: scaling out with consumer processes, the pause of a split, the router.

On Redis Streams with a RedisRouteStore (real Redis; unique names, removed at the end):

1. Throughput of a 1 ms I/O handler (``time.sleep(0.001)``, one handler thread per
   process, ``ordered=True``) over an ordered topic of 4 physical partitions, with 1,
   2 and 4 consumer *processes* (each leases its fair share of the partitions).
   Baseline: 1 process, same run. Goals: 2 processes >= 1.8x, 4 processes >= 3.2x.
   Beside: the consumer processes' CPU per message (all their threads) and messages
   per fetch. Run for both refill modes of the ordered pump, interleaved: the batch
   refill (opt-in for now: ``Fetcher.batch_refill = True``) and its plain twin
   (``Fetcher.batch_refill = False``, the default: one fetch as soon as a slot is
   free).
2. A split under load: 2 consumer processes, a publisher at a steady rate over many
   keys, partition 1 split in the middle of it. The latency (handled - published) of
   the messages of the split partition's keys published around the split, against
   those of the other keys. Goals: p99 of the affected keys <= 1 s; the other keys'
   p99 no more than 0.1 s above their p99 before the split (no pause). Run with the
   topic's defaults (``fence=0.8``, ``route_cache=0.05``, feed ``refresh=0.5``), with
   ``fence=0.5, refresh=0.25``, and with ``fence=0.2, route_cache=0.05, refresh=0.1``.
3. Router cost per publish: ``OrderedTopic.publish`` vs the broker's own ``publish``
   of the same body and key, on InMemoryBroker and on Redis. Goal: <= 10 us more per
   publish.

    python benchmarks/bench_ordered_topics.py [--messages N] [--rate R] [--seconds S]
        [--publishes N] [--repeats R] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import threading
import time
import uuid
from typing import Any

from _bench import bench_line, timed

from msgpatterns.testing import services

PARTITIONS = 4


# -- the consumer processes ----------------------------------------------------------


def consumer_process(cfg: dict[str, Any], index: int) -> None:
    """One consumer process: join the group, wait for 'go', consume until 'stop';
    report handled messages and CPU seconds (and, if asked, every handling)."""
    import redis

    from msgpatterns import Consumer
    from msgpatterns.brokers.redis_streams import RedisStreamsBroker
    from msgpatterns.ordering import OrderedTopic, RedisRouteStore
    from msgpatterns.ordering.topic_feed import TopicFeed
    from msgpatterns.runtime.fetcher import Fetcher

    Fetcher.batch_refill = cfg["batch_refill"]
    client = redis.Redis.from_url(cfg["url"])
    broker = RedisStreamsBroker(cfg["url"], visibility_timeout=120)
    store = RedisRouteStore(cfg["url"], prefix=cfg["prefix"])
    topic = OrderedTopic(broker, cfg["name"], routes=store, route_cache=cfg["route_cache"],
                         fence=cfg["fence"])
    feed = TopicFeed(topic, cfg["group"], owner=f"worker-{index}", lease_ttl=10.0,
                     refresh=cfg["refresh"])
    keys = {k: f"{cfg['name']}:{k}" for k in ("ready", "go", "stop", "count", "results")}
    count = [0]
    fetches = [0]
    feed_fetch = feed.fetch

    def counted_fetch(*args: Any, **kwargs: Any) -> Any:
        got = feed_fetch(*args, **kwargs)
        fetches[0] += bool(got)
        return got

    feed.fetch = counted_fetch  # type: ignore[method-assign]
    handled: list[tuple[str, float, float]] = []
    record = cfg["record"]

    def handler(message: Any) -> None:
        time.sleep(0.001)
        if record:
            handled.append((message.key or "", float(message.raw_body), time.time()))
        count[0] += 1

    while True:  # settle the leases before the clock starts
        feed.rebalance()
        if (len(store.members(cfg["name"], cfg["group"], time.time())) == cfg["processes"]
                and len(feed.held) == cfg["share"]):
            break
        time.sleep(0.05)
    client.incr(keys["ready"])
    while not client.exists(keys["go"]):
        time.sleep(0.005)
    cpu = time.process_time()
    consumer = Consumer(feed, handler, topics=[cfg["name"]], group=cfg["group"],
                        ordered=True, poll_timeout=0.05)
    consumer.start()
    reported = 0
    while not client.exists(keys["stop"]):
        time.sleep(0.02)
        done = count[0]
        if done != reported:
            client.incrby(keys["count"], done - reported)
            reported = done
    consumer.stop(10)
    cpu = time.process_time() - cpu
    client.incrby(keys["count"], count[0] - reported)
    client.rpush(keys["results"], json.dumps({"cpu": cpu, "handled": count[0],
                                              "fetches": fetches[0], "records": handled}))
    feed.close()
    broker.close()
    store.close()
    client.close()


class Run:
    """One topic, its consumer processes and the Redis keys that drive them."""

    def __init__(self, url: str, processes: int, partitions: int, *, record: bool = False,
                 route_cache: float = 0.05, fence: float = 0.8, refresh: float = 0.5,
                 batch_refill: bool = True) -> None:
        import redis

        from msgpatterns.brokers.redis_streams import RedisStreamsBroker
        from msgpatterns.ordering import OrderedTopic, RedisRouteStore

        self.name = f"bench-ot-{uuid.uuid4().hex[:10]}"
        self.cfg = {"url": url, "name": self.name, "prefix": f"{self.name}-routes",
                    "group": "g", "processes": processes,
                    "share": -(-partitions // processes), "record": record,
                    "route_cache": route_cache, "fence": fence, "refresh": refresh,
                    "batch_refill": batch_refill}
        self.client = redis.Redis.from_url(url)
        self.broker = RedisStreamsBroker(url)
        self.store = RedisRouteStore(url, prefix=self.cfg["prefix"])
        self.topic = OrderedTopic(self.broker, self.name, routes=self.store,
                                  route_cache=route_cache, fence=fence)
        self.topic.create(physical=partitions)
        self.procs: list[Any] = []

    def key(self, what: str) -> str:
        return f"{self.name}:{what}"

    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.procs = [ctx.Process(target=consumer_process, args=(self.cfg, i), daemon=True)
                      for i in range(self.cfg["processes"])]
        for proc in self.procs:
            proc.start()
        deadline = time.monotonic() + 120
        while int(self.client.get(self.key("ready")) or 0) < len(self.procs):
            if time.monotonic() > deadline:
                raise RuntimeError("consumer processes did not settle their leases")
            time.sleep(0.02)

    def go(self) -> float:
        self.client.set(self.key("go"), 1)
        return time.perf_counter()

    def handled(self) -> int:
        return int(self.client.get(self.key("count")) or 0)

    def wait_for(self, total: int, within: float = 300) -> float:
        deadline = time.monotonic() + within
        while self.handled() < total:
            if time.monotonic() > deadline:
                raise RuntimeError(f"handled {self.handled()} of {total}")
            time.sleep(0.005)
        return time.perf_counter()

    def stop(self) -> list[dict[str, Any]]:
        self.client.set(self.key("stop"), 1)
        for proc in self.procs:
            proc.join(60)
        return [json.loads(r) for r in self.client.lrange(self.key("results"), 0, -1)]

    def cleanup(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        self.broker.close()
        self.store.close()
        keys = list(self.client.scan_iter(match=f"*{self.name}*"))
        if keys:
            self.client.delete(*keys)
        self.client.close()


# -- 1. throughput with 1, 2, 4 processes ----------------------------------------------


def throughput(url: str, processes: int, messages: int,
               batch_refill: bool) -> tuple[float, float, float]:
    """(messages/s, consumer CPU microseconds per message, messages per fetch)."""
    run = Run(url, processes, PARTITIONS, batch_refill=batch_refill)
    try:
        run.topic.publish_many((f"key-{i % 997}", b"1") for i in range(messages))
        run.start()
        began = run.go()
        ended = run.wait_for(messages)
        results = run.stop()
        cpu = sum(r["cpu"] for r in results)
        assert sum(r["handled"] for r in results) == messages, results
        per_fetch = messages / max(1, sum(r["fetches"] for r in results))
        return messages / (ended - began), cpu / messages * 1e6, per_fetch
    finally:
        run.cleanup()


MODES = (("batch refill", True), ("plain twin", False))


def bench_scaling(url: str, messages: int, repeats: int) -> None:
    """The best of ``repeats`` rounds per refill mode and process count, the rounds
    interleaved (batch 1, 2, 4, twin 1, 2, 4, batch 1, ...) so that each sees the same
    range of machine load."""
    rates: dict[tuple[bool, int], tuple[float, float, float]] = {}
    for _ in range(repeats):
        for label, mode in MODES:
            for processes in (1, 2, 4):
                rate, cpu, per_fetch = throughput(url, processes, messages, mode)
                print(f"{label}: {processes} consumer process(es): {rate:,.0f} msg/s, "
                      f"{cpu:.0f} us CPU per message, {per_fetch:.1f} messages per "
                      "fetch", flush=True)
                if rate > rates.get((mode, processes), (0.0, 0.0, 0.0))[0]:
                    rates[(mode, processes)] = (rate, cpu, per_fetch)
    for label, mode in MODES:
        one, one_cpu, _ = rates[(mode, 1)]
        tag = "" if mode else "_plain_twin"
        for processes, goal in ((2, 1.8), (4, 3.2)):
            rate, cpu, per_fetch = rates[(mode, processes)]
            bench_line("ordered_topics",
                       f"throughput_{processes}_vs_1_process_msg_per_s{tag}", rate, one,
                       rate / one, f">= {goal}x", rate / one >= goal, refill=label,
                       messages=messages, partitions=PARTITIONS, handler="sleep 1 ms",
                       repeats=repeats, cpu_us_per_msg_ours=round(cpu),
                       cpu_us_per_msg_baseline=round(one_cpu),
                       messages_per_fetch=round(per_fetch, 1))
    for processes in (1, 2, 4):
        batch, twin = rates[(True, processes)], rates[(False, processes)]
        bench_line("ordered_topics", f"cpu_us_per_msg_batch_refill_vs_twin_{processes}_proc",
                   batch[1], twin[1], batch[1] / twin[1], "< 1 (less CPU)",
                   batch[1] < twin[1], msg_per_s_ours=round(batch[0]),
                   msg_per_s_baseline=round(twin[0]),
                   messages_per_fetch_ours=round(batch[2], 1),
                   messages_per_fetch_baseline=round(twin[2], 1))


# -- 2. the pause of a split -----------------------------------------------------------


def split_pause(url: str, rate: float, seconds: float, route_cache: float, fence: float,
                refresh: float) -> None:
    from msgpatterns.ordering import logic_partition

    run = Run(url, 2, 2, record=True, route_cache=route_cache, fence=fence, refresh=refresh)
    try:
        route = run.topic.state().committed
        affected_range = route.segment(1).logic
        keys = [f"key-{i}" for i in range(500)]
        affected = {k for k in keys if logic_partition(k, route.logic_partitions)
                    in affected_range}
        run.start()
        run.go()
        published = 0
        split_at: list[float] = []

        def change() -> None:
            time.sleep(seconds / 3)
            split_at.append(time.time())
            run.topic.split(1)
            split_at.append(time.time())

        changer = threading.Thread(target=change)
        changer.start()
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            due = int((time.perf_counter() - start) * rate)
            while published < due:
                run.topic.publish(keys[published % len(keys)], repr(time.time()).encode())
                published += 1
            time.sleep(0.001)
        changer.join()
        run.wait_for(published, within=120)
        results = run.stop()
        records = [r for result in results for r in result["records"]]
        assert len({(k, p) for k, p, _ in records}) == published
        split_start, split_end = split_at
        before, around_hit, around_other = [], [], []
        for key, sent, handled in records:
            latency = handled - sent
            if sent < split_start - 1.0:
                before.append(latency)
            elif sent <= split_end + fence + refresh + 1.0:
                (around_hit if key in affected else around_other).append(latency)
        p99 = {name: _p99(values) for name, values in
               (("before", before), ("hit", around_hit), ("other", around_other))}
        setting = f"fence={fence}s route_cache={route_cache}s refresh={refresh}s"
        print(f"split under load ({rate:.0f} msg/s, {setting}): p99 latency before "
              f"{p99['before'] * 1000:.0f} ms; around the split: affected keys "
              f"{p99['hit'] * 1000:.0f} ms, other keys {p99['other'] * 1000:.0f} ms "
              f"(max affected {max(around_hit) * 1000:.0f} ms)", flush=True)
        tag = f"fence_{fence:g}s"
        bench_line("ordered_topics", f"split_p99_pause_affected_keys_s_{tag}", p99["hit"], 1.0,
                   p99["hit"] / 1.0, "<= 1 s", p99["hit"] <= 1.0, rate=rate,
                   fence=fence, route_cache=route_cache, refresh=refresh,
                   affected_messages=len(around_hit))
        bench_line("ordered_topics", f"split_p99_latency_other_keys_s_{tag}", p99["other"],
                   p99["before"], p99["other"] / max(p99["before"], 1e-9),
                   "<= before + 0.1 s", p99["other"] <= p99["before"] + 0.1, rate=rate,
                   fence=fence, route_cache=route_cache, refresh=refresh,
                   other_messages=len(around_other))
    finally:
        run.cleanup()


def _p99(values: list[float]) -> float:
    if not values:
        return 0.0
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 \
        else values[0]


# -- 3. the router's cost per publish ----------------------------------------------------


def router_cost(label: str, broker: Any, store: Any, publishes: int, repeats: int) -> str:
    """Measure and print; returns the topic's name (for the cleanup)."""
    from msgpatterns.ordering import OrderedTopic
    from msgpatterns.ordering.topic import LOGIC_PARTITION, ROUTE_VERSION

    name = f"bench-ot-{uuid.uuid4().hex[:10]}"
    topic = OrderedTopic(broker, name, routes=store)
    topic.create(physical=PARTITIONS)
    keys = [f"key-{i}" for i in range(1000)]
    plain_topic = topic.partition_topic(0)
    headers = {ROUTE_VERSION: "1", LOGIC_PARTITION: "0"}

    def plain() -> float:
        publish = broker.publish
        return timed(lambda: [publish(plain_topic, b"x", key=keys[i % 1000])
                              for i in range(publishes)])

    def plain_headers() -> float:
        publish = broker.publish
        return timed(lambda: [publish(plain_topic, b"x", key=keys[i % 1000],
                                      headers=dict(headers)) for i in range(publishes)])

    def routed() -> float:
        publish = topic.publish
        return timed(lambda: [publish(keys[i % 1000], b"x") for i in range(publishes)])

    runs: dict[str, list[float]] = {"plain": [], "headers": [], "routed": []}
    cpu: dict[str, list[float]] = {"plain": [], "headers": [], "routed": []}
    for _ in range(repeats):  # interleaved: all three see the same machine load
        for name_, run in (("plain", plain), ("headers", plain_headers), ("routed", routed)):
            started = time.process_time()
            runs[name_].append(run())
            cpu[name_].append(time.process_time() - started)
    base, with_headers, ours = (min(runs[k]) / publishes * 1e6
                                for k in ("plain", "headers", "routed"))
    cpu_base, cpu_ours = (min(cpu[k]) / publishes * 1e6 for k in ("plain", "routed"))
    extra = ours - base
    print(f"{label}: plain publish {base:.1f} us, with the two route headers "
          f"{with_headers:.1f} us, OrderedTopic.publish {ours:.1f} us (+{extra:.1f} us "
          f"over plain, {ours - with_headers:+.1f} us over plain with the headers; least "
          f"of {repeats} runs of {publishes}); client CPU per publish {cpu_base:.1f} us "
          f"plain, {cpu_ours:.1f} us routed", flush=True)
    bench_line("ordered_topics", f"router_us_per_publish_{label}", ours, base, ours / base,
               "<= +10 us", extra <= 10.0, extra_us=round(extra, 2),
               with_headers_us=round(with_headers, 2),
               lookup_us=round(ours - with_headers, 2),
               cpu_us_per_msg_ours=round(cpu_ours, 2), cpu_us_per_msg_baseline=round(cpu_base, 2),
               publishes=publishes,
               repeats=repeats)
    return name


def bench_router(url: str, publishes: int, repeats: int) -> None:
    import redis

    from msgpatterns.brokers import InMemoryBroker
    from msgpatterns.brokers.redis_streams import RedisStreamsBroker
    from msgpatterns.ordering import MemoryRouteStore, RedisRouteStore

    router_cost("memory", InMemoryBroker(record_history=False), MemoryRouteStore(),
                publishes * 10, repeats * 2)
    prefix = f"bench-ot-routes-{uuid.uuid4().hex[:10]}"
    broker = RedisStreamsBroker(url)
    store = RedisRouteStore(url, prefix=prefix)
    name = f"{prefix}-none"
    try:
        name = router_cost("redis", broker, store, publishes, repeats)
    finally:
        broker.close()
        store.close()
        client = redis.Redis.from_url(url)
        for pattern in (f"*{prefix}*", f"{name}*"):
            keys = list(client.scan_iter(match=pattern))
            if keys:
                client.delete(*keys)
        client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--rate", type=float, default=300.0)
    parser.add_argument("--seconds", type=float, default=9.0)
    parser.add_argument("--publishes", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5,
                        help="rounds of the router measure")
    parser.add_argument("--scaling-repeats", type=int, default=2,
                        help="rounds of 1, 2 and 4 processes (the best of each counts)")
    parser.add_argument("--redis-url", default=services.url("redis"))
    parser.add_argument("--skip", action="append", default=[],
                        choices=["scaling", "split", "router"])
    args = parser.parse_args()
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} "
          "CPU(s)", flush=True)
    if "router" not in args.skip:
        bench_router(args.redis_url, args.publishes, args.repeats)
    if "scaling" not in args.skip:
        bench_scaling(args.redis_url, args.messages, args.scaling_repeats)
    if "split" not in args.skip:
        # the topic's defaults, then a shorter fence, then a short fence and cache
        for route_cache, fence, refresh in ((0.05, 0.8, 0.5), (0.05, 0.5, 0.25),
                                            (0.05, 0.2, 0.1)):
            split_pause(args.redis_url, args.rate, args.seconds, route_cache, fence, refresh)


if __name__ == "__main__":
    main()
