"""`distserve`: the command line of the mesh.

Every subcommand lives in a module of its own that exposes `register(subparsers)`
(`distserve.command` says how); `main` builds the parser from `REGISTRARS`. Subcommands import
what they need when they run, so that `distserve --help` is instant and commands that do not run
the model never load torch.
"""

from __future__ import annotations

import sys

from distserve import client, generate, model, plan, trace_report, up
from distserve.command import Registrar, run
from distserve.deploy import cli as deploy
from distserve.loadgen import cli as loadgen

# In the order `distserve --help` lists them.
REGISTRARS: tuple[Registrar, ...] = (
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
    return run(REGISTRARS, argv, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
