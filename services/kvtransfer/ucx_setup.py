"""UCX in a worker process: its settings (UCX_DEFAULTS, --ucx-tls), set before UCX first
starts, whether ucxx is here at all, and closing its listeners and endpoints before the process
exits. Both sides of the data plane run with these settings; nothing here moves data."""

from __future__ import annotations

import argparse
import fcntl
import os
import socket
import struct
import sys

from services.common.errors import FailedPrecondition

_SIOCGIFADDR = 0x8915  # an interface's IPv4 address (linux/sockios.h)


def ucx_available() -> bool:
    """Whether ucxx is importable here (else KV moves over the gRPC fallback only)."""
    try:
        import ucxx  # noqa: F401
    except ImportError:
        return False
    return True


def shutdown_ucx() -> None:
    """Close the process's UCX listeners and endpoints (before it exits)."""
    if "services.kvtransfer.ucx_loop" in sys.modules:  # never started UCX: nothing to close
        from services.kvtransfer import ucx_loop

        ucx_loop.shutdown()


def add_ucx_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ucx-tls",
        default="",
        help="UCX transports (UCX_TLS), e.g. tcp; sm,tcp; rc,cuda_copy,cuda_ipc (default: UCX's "
        "choice: shared memory on one host, RDMA or tcp across hosts, CUDA paths on GPUs)",
    )


# The settings every process of the mesh runs UCX with, unless its environment says otherwise.
UCX_DEFAULTS = {
    # Shared memory between processes of one host. UCX leaves its shared-memory transports
    # (posix, sysv) out of any endpoint that handles peer failure, and every endpoint of ours
    # does (services/kvtransfer/ucx_loop.py): without this, KV between two processes of one
    # host moves over TCP on the loopback device (measured here: 1.1-1.2 GB/s against 5.8-6.7
    # GB/s, memcpy 8-10 GB/s). A dead peer is still noticed: its endpoint fails by UCX's
    # keepalive, and a chunk's own timeout bounds every wait.
    "UCX_MM_ERROR_HANDLING": "y",
    # A single copy between processes of one host: the puller reads the source's KV straight
    # into its blocks (CMA, process_vm_readv) instead of both sides copying through a shared-
    # memory bounce buffer. UCX offers CMA for rendezvous on endpoints that handle peer failure
    # only if its memory domain declares it can invalidate a buffer once a send is cancelled,
    # which CMA's does only when told (this setting): it does not actually invalidate. A
    # cancelled send's blocks may therefore still be read by the puller after the source frees
    # them; no such read is ever used, because a source answers "ok" only after every send of
    # a request completed (the puller has acknowledged reading each), and a request cut off
    # (lease released, lapsed or drained) is refused (the same holds for the bounce buffer: a
    # cut-off send may still copy from freed blocks). Measured here, 64 MiB pulls on 2 cores:
    # the source's CPU per pull 19 -> 6 ms, a pull 2.1-2.9 -> 3.7-4.1 GB/s
    # (`python bench/kvtransfer/kvtransfer.py` measures a pull today).
    # Where CMA is not allowed (ptrace restricted, another PID namespace) UCX keeps to shared
    # memory.
    "UCX_CMA_MEMORY_INVALIDATE": "y",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}


def configure_ucx(args: argparse.Namespace | None = None) -> None:
    """Set UCX_DEFAULTS where the environment has no value, apply --ucx-tls, and keep UCX's
    network devices to the one holding --host; before UCX is first used (UCX reads its
    environment when its context starts, and the processes a worker starts inherit it)."""
    for name, value in UCX_DEFAULTS.items():
        os.environ.setdefault(name, value)
    if args is not None and args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    host = getattr(args, "host", "") if args is not None else ""
    if host and host not in ("0.0.0.0", "::") and "UCX_NET_DEVICES" not in os.environ:
        os.environ["UCX_NET_DEVICES"] = ",".join(net_devices(host))


def net_devices(host: str) -> list[str]:
    """UCX's network devices for a process that listens on `host` alone: the interface holding
    that address (UCX's TCP transport listens on every device it uses, on the device's address)
    and every RDMA port (they open no TCP listener; KV keeps its RDMA path). Raises
    FailedPrecondition when no interface of this machine holds `host`."""
    try:
        address = socket.gethostbyname(host)
    except OSError as e:
        raise FailedPrecondition(f"--host {host}: {e}") from e
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == address:
            return [name, *_rdma_ports()]
    raise FailedPrecondition(
        f"--host {host}: no network interface of this machine has this address (give one of "
        "its addresses, or 0.0.0.0 to listen on all)"
    )


def _ipv4_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            ifreq = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()))
        except OSError:  # no IPv4 address
            return None
    return socket.inet_ntoa(ifreq[20:24])


def _rdma_ports(root: str = "/sys/class/infiniband") -> list[str]:
    if not os.path.isdir(root):
        return []
    return [
        f"{dev}:{port}"
        for dev in sorted(os.listdir(root))
        for port in sorted(os.listdir(os.path.join(root, dev, "ports")))
    ]
