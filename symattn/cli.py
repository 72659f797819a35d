"""The ``symattn`` command line: list, derive, generate, check.

Bad input — an unknown spec, target, format or option — exits 2 with one line on
stderr and no traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from symattn.errors import SymattnError


class UsageError(SymattnError):
    """A command-line argument argparse refused."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (see main)
        raise UsageError(f"{self.prog}: {message}")


def cmd_list(args: argparse.Namespace) -> int:
    """One line per built-in spec: name and forward expression."""
    from symattn.specs import spec, specs

    for name in specs():
        print(f"{name:16s} {spec(name).summary}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="symattn", description="Derive, print and generate attention gradients.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("list", help="the built-in specs, one line each").set_defaults(handler=cmd_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    try:
        args = build_parser().parse_args(argv)
        return args.handler(args)
    except SymattnError as err:
        print(f"symattn: error: {err}" if not isinstance(err, UsageError) else f"{err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
