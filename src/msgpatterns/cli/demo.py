"""``msgpatterns demo``: runs the demos of :mod:`msgpatterns.demo`."""

from __future__ import annotations

import argparse

from msgpatterns.cli._options import (
    Subcommands,
    non_empty,
    non_negative_int,
    positive_int,
    rate,
    sql_url,
)
from msgpatterns.demo import orders

__all__ = ["register"]


def register(sub: Subcommands) -> None:
    """Add ``demo`` to the ``msgpatterns`` command."""
    parser = sub.add_parser(
        "demo",
        help="run the order-status demo on a misbehaving in-memory broker",
        description=orders.__doc__.split("\n\n")[0] if orders.__doc__ else None,
    )
    parser.add_argument("--orders", type=positive_int, default=500,
                        help="orders (4 events each)")
    parser.add_argument("--malformed", type=non_negative_int, default=3,
                        help="malformed messages to inject")
    parser.add_argument("--duplicate-rate", type=rate, default=0.1)
    parser.add_argument("--reorder-window", type=non_negative_int, default=32)
    parser.add_argument("--lost-ack-rate", type=rate, default=0.05)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workers", type=positive_int, default=4)
    parser.add_argument("--db", default=None, type=non_empty,
                        help="SQLAlchemy URL (default: a new SQLite file)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--spark", action="store_true",
                        help="run the Spark Structured Streaming variant instead")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    """Run the demo ``args`` ask for; 0 when its final state is exact."""
    if args.spark:
        from msgpatterns.demo.spark import run_spark_demo  # needs the [spark] extra

        return 0 if run_spark_demo(args) else 1
    db = None if args.db is None else \
        sql_url(args.db).render_as_string(hide_password=False)  # with a connect timeout
    result = orders.run_demo(
        orders=args.orders, malformed=args.malformed, duplicate_rate=args.duplicate_rate,
        reorder_window=args.reorder_window, lost_ack_rate=args.lost_ack_rate,
        seed=args.seed, workers=args.workers, db=db, progress=not args.no_progress,
    )
    return 0 if result.exact else 1
