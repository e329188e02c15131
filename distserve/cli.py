"""`distserve`: the command line of the mesh.

Every subcommand lives in a module of its own that exposes `register(subparsers)`, adding its
parser(s) with `set_defaults(func=...)`; `main` builds the parser from `REGISTRARS`. Subcommands
import what they need when they run, so that `distserve --help` is instant and commands that do
not run the model never load torch.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from distserve import client, generate, model, plan, trace_report, up
from distserve.deploy import cli as deploy
from distserve.loadgen import cli as loadgen
from services.common.errors import DistServeError

# In the order `distserve --help` lists them.
REGISTRARS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    model.register,  # model create
    generate.register,  # generate, chat
    up.register,  # up
    client.register,  # client
    trace_report.register,  # trace-report
    plan.register,  # plan, profile
    loadgen.register,  # bench
    deploy.register,  # deploy
)


def main(argv: list[str] | None = None) -> int:
    return run(REGISTRARS, argv)


def run(registrars, argv: list[str] | None = None, description: str | None = None) -> int:
    """`distserve` with the subcommands of `registrars` (a tool module run on its own passes
    its one `register`): parse `argv`, run the command, a DistServeError as exit status 2."""
    description = description or __doc__.splitlines()[0]
    parser = argparse.ArgumentParser(prog="distserve", description=description)
    sub = parser.add_subparsers(dest="command", required=True)
    for register in registrars:
        register(sub)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except DistServeError as e:
        print(f"distserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
