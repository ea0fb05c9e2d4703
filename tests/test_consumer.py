"""DESIGN 7: ``Consumer.run()`` stops gracefully on SIGTERM (in a child process: the
signal goes to its main thread). Every other consumer-level behaviour - flow control,
the worker pool, stop without loss, run_until_idle, settlement under injected broker
faults - is in the parity suite (``tests/parity/``), on both drivers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

SIGTERM_SCRIPT = textwrap.dedent(
    """
    import json, sys, threading
    from msgpatterns import Consumer, InMemoryBroker

    broker = InMemoryBroker(seed=0)
    for i in range(5000):
        broker.publish("t", i)
    started = threading.Event()

    def handler(message):
        if not started.is_set():
            started.set()
            print("READY", flush=True)

    consumer = Consumer(broker, handler, topics=["t"], group="g", workers=4,
                        max_in_flight=64)
    consumer.run()  # returns after SIGTERM, once in-flight work is settled
    print(json.dumps({"acked": len({m.id for m in broker.acked}),
                      "pending": broker.pending, "in_flight": broker.in_flight()}))
    """
)


def test_sigterm_stops_run_gracefully() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", SIGTERM_SCRIPT], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "READY"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["in_flight"] == 0
    assert summary["acked"] + summary["pending"] == 5000
    assert summary["acked"] > 0
