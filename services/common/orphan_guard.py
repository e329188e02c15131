"""`python -m services.common.orphan_guard PARENT_PID PROGRAM [ARGS...]`: run PROGRAM so that it
gets SIGTERM when the process PARENT_PID dies, even if that process is killed.

The launcher starts every child through this instead of setting PR_SET_PDEATHSIG between fork
and exec (`preexec_fn`): running Python code in a child forked from a process with gRPC threads
can abort it. The setting survives the exec into PROGRAM.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def command(argv: list[str]) -> list[str]:
    """`argv`, run under the guard of this process."""
    return [sys.executable, "-m", "services.common.orphan_guard", str(os.getpid()), *argv]


def main() -> None:
    parent, argv = int(sys.argv[1]), sys.argv[2:]
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the line above
        sys.exit(1)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
