"""Every listener of the mesh's processes is bound to the address each was given (--host): a
worker on 127.0.0.1 is not reachable from the machine's other addresses, nor is its KV.

Read from /proc, as `ss -ltnp` would: a process's listening TCP sockets are the entries of
/proc/<pid>/net/tcp{,6} in state LISTEN whose inode is one of the process's file descriptors.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct

import numpy as np
import pytest

from services.common.errors import FailedPrecondition
from services.kvtransfer.ucx_setup import net_devices, ucx_available
from tests.conftest import start_mesh, stop_now
from tests.test_mesh import generate, stats

_LISTEN = "0A"  # TCP_LISTEN in /proc/net/tcp


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket the process `pid` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = set()
    for family, table in ((socket.AF_INET, "tcp"), (socket.AF_INET6, "tcp6")):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] != _LISTEN or fields[9] not in inodes:
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # 32-bit words, each in host (little-endian) order
                words = struct.unpack(f"<{len(raw) // 4}I", raw)
                text = socket.inet_ntop(family, struct.pack(f">{len(words)}I", *words))
                found.add((text.removeprefix("::ffff:"), int(port, 16)))  # v4-mapped: the same
    return found


@pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")
def test_a_mesh_on_127_0_0_1_listens_on_no_other_address(tiny_model):
    mesh = start_mesh(
        tiny_model,
        worker_args=("--kv-cache-gib", "0.015625", "--health-port", "0"),
        decode_args=("--kv-transport", "ucx"),  # the KV moves over UCX, or the request fails
    )
    try:
        ids, _, _ = asyncio.run(generate(mesh.gateway_address, "Hello, bound listeners", 8))
        assert len(ids) == 8
        decode = next(p for p in mesh.workers if p.name.startswith("decode"))
        assert stats(decode.ready["address"], "decode").pulls_total >= 1
        prefill = next(p for p in mesh.workers if p.name.startswith("prefill"))
        seen = {proc.name: listening(proc.popen.pid) for proc in mesh.processes}
        print({name: sorted(s) for name, s in seen.items()})
        for name, sockets in seen.items():
            assert sockets, f"{name}: no listening socket found (the test reads /proc wrongly)"
            others = {s for s in sockets if s[0] != "127.0.0.1"}
            assert not others, f"{name} listens beyond 127.0.0.1: {sorted(others)}"
        ports = {port for _, port in seen[prefill.name]}
        assert int(prefill.ready["address"].rsplit(":", 1)[1]) in ports
        assert int(prefill.ready["health_address"].rsplit(":", 1)[1]) in ports
        assert int(prefill.ready["metrics_address"].rsplit(":", 1)[1]) in ports
        assert prefill.ready["ucx_port"] in ports, (
            "the prefill's UCX listener is not among its listeners"
        )
    finally:
        stop_now(mesh)


def test_ucx_devices_are_those_of_the_given_address_and_others_are_refused_by_name():
    assert net_devices("127.0.0.1")[0] == "lo"
    with pytest.raises(FailedPrecondition, match=r"--host 192\.0\.2\.254: no network interface"):
        net_devices("192.0.2.254")


@pytest.mark.skipif(not ucx_available(), reason="ucxx is not installed")
def test_a_bound_ucx_listener_accepts_on_its_address_and_refuses_ipv6_by_name():
    from services.kvtransfer import ucx_loop
    from services.kvtransfer.ucx_bind import UcxBindError

    async def main() -> tuple[set[tuple[str, int]], int]:
        got = asyncio.Queue()

        async def accept(ep) -> None:
            buf = np.zeros(4, dtype=np.uint8)
            await ep.recv(buf)
            got.put_nowait(bytes(buf))

        w = ucx_loop.worker()
        with pytest.raises(UcxBindError, match="IPv4 addresses only"):
            w.listen(accept, host="::1")
        listener = w.listen(accept, host="127.0.0.1")
        ep = await w.connect("127.0.0.1", listener.port)
        await ep.send(np.frombuffer(b"kv!!", dtype=np.uint8))
        assert await asyncio.wait_for(got.get(), 10) == b"kv!!"
        sockets, port = listening(os.getpid()), listener.port
        ep.abort()
        listener.close()
        ucx_loop.shutdown()
        return sockets, port

    sockets, port = asyncio.run(main())
    assert ("127.0.0.1", port) in sockets
    assert ("0.0.0.0", port) not in sockets
