"""``msgpatterns dedup purge``: delete expired dedup records from a SQL table.

SQL has no TTL, so a dedup table grows until it is purged. Only records whose expiry
passed at least --older-than ago are deleted: a live lease or a DONE record within its
ttl is never touched. Large tables are purged in short transactions of --chunk rows,
with a progress bar. Redis needs no purge (every key has a TTL).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Iterator

from msgpatterns._escape import escape_control
from msgpatterns.cli._options import Subcommands, non_empty, positive_int, sql_engine

__all__ = ["parse_age", "register"]

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)?")


def parse_age(text: str) -> float:
    """Seconds in an age like ``7d``, ``12h``, ``1d12h``, ``90m``, ``30s`` or ``45``."""
    cleaned = text.strip().lower()
    total, position = 0.0, 0
    for match in _PART.finditer(cleaned):
        if match.start() != position:
            break
        total += float(match.group(1)) * _UNITS[match.group(2) or "s"]
        position = match.end()
    if not cleaned or position != len(cleaned):
        raise argparse.ArgumentTypeError(
            f"invalid age {text!r}: use a number with a unit, e.g. 7d, 12h, 1d12h, 30m, 45s"
        )
    return total


def register(sub: Subcommands) -> None:
    """Add ``dedup purge`` to the ``msgpatterns`` command."""
    dedup = sub.add_parser("dedup", help="maintain idempotency (dedup) stores",
                           description="Maintain idempotency (dedup) stores.")
    actions = dedup.add_subparsers(dest="dedup_command", metavar="ACTION")
    actions.required = True
    purge = actions.add_parser("purge", help="delete expired dedup records",
                               description=__doc__.split("\n\n")[1] if __doc__ else None)
    purge.add_argument("--url", required=True, type=non_empty,
                       help="SQLAlchemy URL of the database (or a redis:// URL: no-op)")
    purge.add_argument("--older-than", type=parse_age, default=0.0, metavar="AGE",
                       help="only records that expired at least AGE ago, e.g. 7d "
                            "(default: every expired record)")
    purge.add_argument("--table", default="msgpatterns_dedup", type=non_empty,
                       help="the dedup table")
    purge.add_argument("--chunk", type=positive_int, default=5000,
                       help="rows per transaction")
    purge.add_argument("--no-progress", action="store_true", help="no progress bar")
    purge.set_defaults(func=run_purge)


def run_purge(args: argparse.Namespace) -> int:
    """Purge; exit 0 on success, 1 when the table does not exist. The database is
    given up on after ``msgpatterns.cli.CONNECT_TIMEOUT`` seconds; failures propagate
    to the command's one-line error report."""
    scheme = args.url.split(":", 1)[0]
    if scheme in ("redis", "rediss", "unix"):
        print("Redis expires dedup keys by their TTL: nothing to purge.")
        return 0
    import sqlalchemy as sa

    from msgpatterns.idempotency.sql import SqlChecker

    engine = sql_engine(args.url)
    try:
        checker = SqlChecker(engine, args.table)
        where = engine.url.render_as_string(hide_password=True)
        if not sa.inspect(engine).has_table(args.table):
            print(f"no table {args.table!r} at {escape_control(where)}", file=sys.stderr)
            return 1
        total = checker.count_expired(args.older_than)
        batches = checker.purge_batches(args.older_than, chunk=args.chunk)
        deleted = sum(_with_progress(batches, total, args.table, not args.no_progress))
        print(f"purged {deleted} expired record(s) from {escape_control(args.table)} "
              f"at {escape_control(where)}")
        return 0
    finally:
        engine.dispose()


def _with_progress(batches: Iterable[int], total: int, table: str, show: bool) -> Iterator[int]:
    """Pass the batch counts through, advancing a rich progress bar on stderr."""
    if not show or total == 0:
        yield from batches
        return
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn
    except ImportError:  # the [cli] extra is not installed: plain output
        yield from batches
        return
    columns = (f"purging {table}", BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:
        task = progress.add_task("purge", total=total)
        for count in batches:
            progress.advance(task, count)
            yield count
