"""The UCX settings workers start with: shared memory on, KV between processes of one host
read in a single copy, an explicit environment kept."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from services.kvtransfer.ucx_setup import UCX_DEFAULTS, configure_ucx

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_workers_turn_on_shared_memory_and_keep_what_the_environment_says(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k not in [*UCX_DEFAULTS, "UCX_TLS"]}
    env["UCX_CMA_MEMORY_INVALIDATE"] = "n"  # an operator's choice
    monkeypatch.setattr(os, "environ", env)  # this process's own environment stays as it was
    configure_ucx(argparse.Namespace(ucx_tls="tcp,sm,self"))

    # Without it UCX leaves sysv/posix out of every endpoint our listeners accept.
    assert os.environ["UCX_MM_ERROR_HANDLING"] == "y"
    assert os.environ["UCX_CMA_MEMORY_INVALIDATE"] == "n"
    assert os.environ["UCX_TLS"] == "tcp,sm,self"


# Two processes of one host with the workers' UCX settings: one listens, the other connects,
# sends a message large enough for rendezvous and prints its endpoint's lanes and protocols
# (ucp_ep_print_info: UCX's own account of what it chose).
_PEER = r"""
import asyncio, ctypes, os, sys
from services.kvtransfer.ucx_setup import configure_ucx, shutdown_ucx
configure_ucx()
import libucx, numpy as np
from services.kvtransfer import ucx_loop

async def listen():
    got = asyncio.Event()
    async def serve(ep):
        await ep.recv(np.empty(1 << 20, dtype=np.uint8))
        got.set()
    listener = ucx_loop.worker().listen(serve)
    print(listener.port, flush=True)
    await asyncio.wait_for(got.wait(), 60)
    await asyncio.sleep(0.1)

async def connect(port):
    ep = await ucx_loop.worker().connect("127.0.0.1", port)
    await ep.send(np.ones(1 << 20, dtype=np.uint8))
    ucp = ctypes.CDLL(os.path.join(os.path.dirname(libucx.__file__), "lib", "libucp.so"))
    libc = ctypes.CDLL(None)
    libc.open_memstream.restype = ctypes.c_void_p
    text, size = ctypes.c_char_p(), ctypes.c_size_t()
    stream = ctypes.c_void_p(libc.open_memstream(ctypes.byref(text), ctypes.byref(size)))
    ucp.ucp_ep_print_info(ctypes.c_void_p(ep.ucp_handle), stream)
    libc.fclose(stream)
    print(text.value.decode(), flush=True)
    await ep.close()

asyncio.run(listen() if sys.argv[1] == "listen" else connect(int(sys.argv[2])))
shutdown_ucx()
"""


def _ptrace_restricted() -> bool:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return f.read().strip() != "0"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(_ptrace_restricted(), reason="ptrace is restricted here: UCX cannot use CMA")
def test_kv_between_processes_of_one_host_is_read_in_a_single_copy():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "UCXPY_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    listener = subprocess.Popen(
        [sys.executable, "-c", _PEER, "listen"], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        port = listener.stdout.readline().strip()
        assert port.isdigit(), "the listening process did not start"
        out = subprocess.run(
            [sys.executable, "-c", _PEER, "connect", port],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        listener.wait(timeout=60)
    finally:
        listener.kill()
    info = out.stdout
    # The bandwidth lane is CMA, and large tagged messages are read by the receiver straight
    # from the sender's memory (not copied in and out of a shared-memory bounce buffer).
    lanes = [line for line in info.splitlines() if "lane[" in line]
    assert any("cma/memory" in line and "rma_bw" in line for line in lanes), info
    tag_table = info.split("tagged message by ucp_tag_send* from host memory", 1)[1]
    large = next(line for line in tag_table.splitlines() if "..inf" in line)
    assert "rendezvous zero-copy read from remote" in large and "cma/memory" in large, info


# UCX settings that UCX reads through the transports inheriting them, not under their own name.
_INHERITED = {"UCX_MM_ERROR_HANDLING": ("UCX_POSIX_ERROR_HANDLING", "UCX_SYSV_ERROR_HANDLING")}


def test_ucx_reads_every_setting_the_workers_make(monkeypatch):
    # Workers silence UCX's warning about variables it does not know (UCX_WARN_UNUSED_ENV_VARS),
    # so a misspelt or renamed setting would be dropped without a word: ask UCX itself.
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    monkeypatch.setattr(os, "environ", env)
    configure_ucx()
    import libucx

    root = os.path.dirname(libucx.__file__)
    shown = subprocess.run(
        [os.path.join(root, "bin", "ucx_info"), "-c"],
        capture_output=True,
        text=True,
        env={**env, "LD_LIBRARY_PATH": os.path.join(root, "lib")},
        timeout=60,
    ).stdout.splitlines()
    for name, value in UCX_DEFAULTS.items():
        if name.startswith("UCX_"):
            for read_as in _INHERITED.get(name, (name,)):
                assert f"{read_as}={value}" in shown, f"UCX does not read {name}={value}"
