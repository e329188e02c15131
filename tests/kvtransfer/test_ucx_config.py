"""The UCX settings workers start with: shared memory on, an explicit environment kept."""

from __future__ import annotations

import argparse
import os

from services.kvtransfer.transports import UCX_DEFAULTS, configure_ucx


def test_workers_turn_on_shared_memory_and_keep_what_the_environment_says(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k not in [*UCX_DEFAULTS, "UCX_TLS"]}
    env["UCXPY_PROGRESS_MODE"] = "blocking"  # an operator's choice
    monkeypatch.setattr(os, "environ", env)  # this process's own environment stays as it was
    configure_ucx(argparse.Namespace(ucx_tls="tcp,sm,self"))

    # Without it UCX leaves sysv/posix out of every endpoint ucxx's listeners create.
    assert os.environ["UCX_MM_ERROR_HANDLING"] == "y"
    assert os.environ["UCXPY_ENABLE_PYTHON_FUTURE"] == "1"
    assert os.environ["UCXPY_PROGRESS_MODE"] == "blocking"
    assert os.environ["UCX_TLS"] == "tcp,sm,self"
