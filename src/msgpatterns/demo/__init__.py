"""Demos: application code built on the library (the library never imports it).

* :mod:`msgpatterns.demo.orders` - ``msgpatterns demo``: an order-status pipeline on
  a misbehaving in-memory broker, ending exact;
* :mod:`msgpatterns.demo.spark` - ``msgpatterns demo --spark``: the same pipeline on
  Spark Structured Streaming (needs the ``[spark]`` extra; imported on use);
* :mod:`msgpatterns.demo.console` - the steps, the result and the console both share.
"""

from __future__ import annotations

from msgpatterns.demo.console import STEPS, DemoResult
from msgpatterns.demo.orders import TOPIC, build_handler, parse_event, run_demo

__all__ = ["STEPS", "TOPIC", "DemoResult", "build_handler", "parse_event", "run_demo"]
