"""Several etcd members per process, and several planners (issue 49: the etcd client side).

A real 3-member etcd (distserve/etcd.py's `EtcdCluster`) under a 1P1D mesh on the tiny
model whose processes are given all three members (`--etcd A,B,C`). The member they all use
(the first listed), made the cluster's leader, is SIGKILLed: every worker's lease is renewed
through another member (the same lease, its entry kept past its TTL) and neither worker ever
leaves the gateway's view. And `distserve up --planners 2`'s mesh: two planner processes elect
one leader on the mesh's etcd; SIGKILLing it hands over to the other within the lease."""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import time
import urllib.request

from distserve.local_mesh import Mesh, MeshSpec
from services.common.etcd_client import EtcdConfig
from tests.conftest import MESH_WORKER_ARGS, stop_now
from tests.test_etcd_quorum import WORKER_TTL_S, _listed, cluster  # noqa: F401 (fixture)
from tests.test_mesh import PROMPTS, expected, generate, wait_until


def _leases(c) -> dict[str, int]:
    """Each worker entry's lease, read from the living members."""
    alive = [url for url, p in zip(c.clients, c.members, strict=True) if p.poll() is None]
    out = json.loads(c.ctl("get", "--prefix", "/distserve/workers/", "-w", "json", endpoints=alive))
    return {_name(kv["key"]): kv["lease"] for kv in out.get("kvs", [])}


def _name(key: str) -> str:
    return base64.b64decode(key).decode().rsplit("/", 1)[-1]


def test_a_mesh_given_every_member_keeps_its_leases_and_view_when_its_member_dies(
    cluster,  # noqa: F811
    mesh_factory,
    tiny_model,
):
    etcd = EtcdConfig(tuple(cluster.clients))
    mesh = mesh_factory(prefill=1, decode=1, etcd=etcd)
    workers = {"prefill-0", "decode-0"}
    assert _listed(mesh.gateway_address) == workers
    before = _leases(cluster)
    assert before.keys() == workers
    # The member every process uses (the first listed) leads the cluster, and dies.
    (m0,) = cluster.status([cluster.clients[0]])
    member_0 = m0["Status"]["header"]["member_id"]
    if m0["Status"]["leader"] != member_0:
        cluster.ctl("move-leader", f"{member_0:x}")
    cluster.kill(0)
    alive = cluster.clients[1:]
    cluster.wait_led(alive, 15)
    # Past a TTL and more, polled all along: nobody ever left the gateway's view ...
    deadline = time.monotonic() + WORKER_TTL_S * 1.5
    while time.monotonic() < deadline:
        assert _listed(mesh.gateway_address) == workers
        time.sleep(0.2)
    # ... and each entry is still under the lease it had: renewed through another member.
    assert _leases(cluster) == before
    # The gateway's watch goes on too: a worker that drains leaves its view.
    mesh.stop_worker("decode-0")
    wait_until(lambda: _listed(mesh.gateway_address) == {"prefill-0"}, what="decode-0 gone")
    assert _leases(cluster).keys() == {"prefill-0"}


def _leader_gauge(planner) -> float:
    url = f"http://{planner.ready['metrics_address']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("distserve_planner_leader "):
                return float(line.split()[1])
    raise AssertionError("no distserve_planner_leader gauge")


def test_up_with_two_planners_elects_one_and_hands_over_when_it_is_killed(tiny_model):
    ttl_s = 2.0
    spec = MeshSpec(
        model=tiny_model,
        prefill=1,
        decode=1,
        gateway_port=0,
        worker_args=MESH_WORKER_ARGS,
        planner=True,
        planners=2,
        planner_args=("--election-ttl-s", str(ttl_s)),
    )
    mesh = Mesh(spec)
    try:
        mesh.start()
        planners = mesh.planners
        assert [p.name for p in planners] == ["planner", "planner-1"]
        wait_until(
            lambda: sorted(map(_leader_gauge, planners)) == [0.0, 1.0],
            timeout=30,
            what="one leader of two",
        )
        lead = next(p for p in planners if _leader_gauge(p) == 1.0)
        standby = next(p for p in planners if p is not lead)
        lead.popen.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: _leader_gauge(standby) == 1.0, timeout=ttl_s + 5, what="a takeover")
        took = time.monotonic() - killed
        assert took <= ttl_s + 1.5, f"the standby led {took:.2f} s after the kill"
        # The mesh serves throughout (the planners are off the data path).
        want = expected(tiny_model, PROMPTS[:1], 8)[0][0]
        assert asyncio.run(generate(mesh.gateway_address, PROMPTS[0], 8))[0] == want
    finally:
        stop_now(mesh)
