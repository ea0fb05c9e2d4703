"""The ``msgpatterns`` command: ``demo``, ``dlq``, ``dedup purge``, ``topic``;
``msgpatterns --version`` prints the library's version.

The command is application code on top of the library: the library never imports it.
Each subcommand is a module of this package with ``register(subcommands)``, which adds
its parser and sets ``func`` on it; :data:`COMMANDS` lists them explicitly.

What a user sees when something goes wrong (the contract):

* one line on stderr that names what failed and how to fix it, never a traceback
  (``msgpatterns --debug ...`` shows the traceback and the libraries' logs);
* exit code 2 for a usage error (a bad option value, an unknown URL scheme or SQL
  driver), 1 for a runtime failure (an unreachable server, a refused login);
* every server the command talks to is given up on after :data:`CONNECT_TIMEOUT`
  seconds, and a refused login is never retried;
* credentials are redacted from every URL the command prints;
* text that comes from messages or servers (a dead letter's reason, key, id, body and
  traceback, an error's text) is printed with its control characters escaped
  (``msgpatterns._escape.escape_control``): a hostile producer cannot move the cursor,
  clear the screen, fake a line, set the window title or write the clipboard. ``--json``
  output is JSON with ASCII escapes.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from msgpatterns import __version__
from msgpatterns._escape import escape_control
from msgpatterns.cli import dedup, demo, dlq, topic
from msgpatterns.cli._explain import explain, target_of
from msgpatterns.cli._options import (
    CONNECT_TIMEOUT,
    ArgumentParser,
    Subcommands,
    non_empty,
    non_negative_int,
    positive_int,
    rate,
    redact_url,
    sql_engine,
    sql_url,
)

__all__ = [
    "COMMANDS",
    "CONNECT_TIMEOUT",
    "ArgumentParser",
    "Subcommands",
    "build_parser",
    "explain",
    "main",
    "non_empty",
    "non_negative_int",
    "positive_int",
    "rate",
    "redact_url",
    "sql_engine",
    "sql_url",
]

#: The subcommands, in the order ``--help`` lists them: each adds its parser.
COMMANDS: tuple[Callable[[Subcommands], None], ...] = (
    demo.register,
    dedup.register,
    dlq.register,
    topic.register,
)


# -- the command --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``msgpatterns`` parser with every subcommand of :data:`COMMANDS`."""
    parser = ArgumentParser(
        prog="msgpatterns",
        description="Reliable message consumers: demo, dead-letter, dedup and ordered-topic tools.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}",
                        help="print the version of msgpatterns and exit")
    parser.add_argument("--debug", action="store_true",
                        help="on failure show the traceback, and the libraries' logs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for register in COMMANDS:
        register(sub)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse; trailing positionals after the options (``dlq replay URL --topic t ID``)
    go to the command's ``trailing`` destination when it declares one."""
    args, extras = parser.parse_known_args(argv)
    trailing: str | None = getattr(args, "trailing", None)
    if extras:
        if trailing is None or any(e.startswith("-") for e in extras):
            parser.error(f"unrecognized arguments: {' '.join(extras)}")
        setattr(args, trailing, [*getattr(args, trailing), *extras])
    return args


def _quiet_logging(debug: bool) -> None:
    """Library logs (reconnect warnings, librdkafka) stay off stderr unless --debug."""
    root = logging.getLogger()
    if debug:
        logging.basicConfig(level=logging.DEBUG,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    elif not root.handlers:  # a host that configured logging keeps its handlers
        root.addHandler(logging.NullHandler())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit code (0 success, 1 failure, 2 usage error)."""
    parser = build_parser()
    args = _parse(parser, argv)
    _quiet_logging(args.debug)
    run: Callable[[argparse.Namespace], int | None] = args.func
    try:
        return int(run(args) or 0)
    except (Exception, KeyboardInterrupt) as exc:
        if args.debug:
            raise
        code, line = explain(exc, target_of(args))
        # an error's text may quote a server's reply or a message: escaped, one line
        print(f"msgpatterns: {escape_control(line)}", file=sys.stderr)
        return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
