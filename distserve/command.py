"""How every `distserve` tool builds and runs its command line: `run(registrars, argv)`.

A tool module exposes `register(subparsers)`, adding its parser(s) with `set_defaults(func=...)`.
`distserve.cli` runs all of them; a tool module run on its own (`python -m distserve.plan ...`)
runs its one `register` through the same `run`, so both share one parser, one error path and one
exit status, and neither imports the other.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterable

from distserve import __version__
from services.common.errors import DistServeError

Registrar = Callable[[argparse._SubParsersAction], None]


def run(registrars: Iterable[Registrar], argv: list[str] | None, description: str) -> int:
    """`distserve` with the subcommands of `registrars`: parse `argv`, run the command, a
    DistServeError as exit status 2."""
    parser = argparse.ArgumentParser(prog="distserve", description=description)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for register in registrars:
        register(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except DistServeError as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 2
