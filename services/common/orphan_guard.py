"""`python -m services.common.orphan_guard PARENT_PID PROGRAM [ARGS...]`: run PROGRAM so that it
gets SIGTERM when the process PARENT_PID dies, even if that process is killed.

The launcher starts every child through this instead of setting PR_SET_PDEATHSIG between fork
and exec (`preexec_fn`): running Python code in a child forked from a process with gRPC threads
can abort it. The setting survives the exec into PROGRAM.

PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not only the process: a
child started from a short-lived thread (the planner's actuator applies a change on one) got
SIGTERM the moment that thread ended. `popen` forks every guarded child from one thread that
lives as long as this process.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

_PR_SET_PDEATHSIG = 1


_FORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orphan-guard")


def command(argv: list[str]) -> list[str]:
    """`argv`, run under the guard of this process (start it with `popen`)."""
    return [sys.executable, "-m", "services.common.orphan_guard", str(os.getpid()), *argv]


def popen(args: list[str], **kwargs) -> subprocess.Popen:
    """`subprocess.Popen(args, **kwargs)` forked from this process's long-lived forking
    thread, whichever thread asks: a guarded child (`args` from `command`) then dies with this
    process, never with the thread that asked."""
    return _FORKER.submit(subprocess.Popen, args, **kwargs).result()


def main() -> None:
    parent, argv = int(sys.argv[1]), sys.argv[2:]
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the line above
        sys.exit(1)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main()
