"""The ``msgpatterns`` command: ``demo``, ``dlq``, ``dedup purge``, ``bench``.

Subcommands live next to the part they serve; each such module exposes
``register(subparsers)`` and sets ``func`` on its parser.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

# Modules that add subcommands; a missing optional dependency only hides that command.
COMMAND_MODULES = (
    "msgpatterns.demo",
    "msgpatterns.idempotency.cli",
    "msgpatterns.brokers.cli",
    "msgpatterns.bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="msgpatterns",
        description="Reliable message consumers: demo, dead-letter and dedup tools.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and name.startswith(exc.name):
                continue  # that part is not built yet / not installed
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
