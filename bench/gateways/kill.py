"""bench/gateways/gateways.py's fault parts on the real engine (`tiny`): a gateway SIGKILLed
in turn every few seconds under load (`kill_part`), and a 3-member etcd losing its leader under
load (`etcd_part`). What each figure counts: gateways.py's docstring."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.gateways.faults import (
    EDGE,
    ClosedLoop,
    Outcome,
    access_log,
    kv_settled,
    restart_gateway,
)
from distserve.etcd import EtcdCluster
from distserve.loadgen.report import log
from distserve.local_mesh import Mesh, MeshSpec
from services.common.etcd_client import EtcdConfig
from services.common.model_config import ModelConfig
from services.engine.presets import default_model

LEASE_S = 5.0  # prefill's KV lease: what a dead gateway's requests held is free within it
REAL = "real, tiny (random weights), CPU"


@dataclasses.dataclass(frozen=True)
class Kill:
    at: float  # monotonic s
    gateway: str
    port: str  # the gateway's gRPC port (it keeps it when restarted)


async def _kill_in_turn(mesh: Mesh, vocab: int, seconds: float, every: float):
    stop = asyncio.Event()
    load = ClosedLoop(mesh.edge_address, vocab)
    running = asyncio.create_task(load.run(stop))
    kills: list[Kill] = []
    end = time.monotonic() + seconds
    while time.monotonic() + every < end:
        await asyncio.sleep(every)
        victim = mesh.gateways[len(kills) % 2]
        victim.popen.kill()
        kills.append(
            Kill(time.monotonic(), victim.name, victim.ready["address"].rpartition(":")[2])
        )
        victim.popen.wait()
        await asyncio.to_thread(restart_gateway, mesh, victim)
        log(f"kill: {victim.name} SIGKILLed and restarted ({len(kills)})")
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    stop.set()
    return await running, kills


def _on_killed(o: Outcome, entry: dict | None, kills: list[Kill]) -> bool:
    """Whether the request was on a gateway (its last attempt's, in Envoy's log) when it died."""
    port = (entry or {}).get("upstream", "").rpartition(":")[2]
    return any(o.start <= k.at <= o.end and port == k.port for k in kills)


def _envoy_counter(envoy, name: str) -> int:
    url = f"http://{envoy.admin_address}/stats?format=json&filter=^{name}$"
    with urllib.request.urlopen(url, timeout=5) as r:
        found = json.load(r)["stats"]
    return int(found[0]["value"]) if found else 0


def kill_part(seconds: float, every: float) -> dict:
    model = default_model("tiny")
    vocab = ModelConfig.from_dir(model).vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "access.log"
        spec = MeshSpec(
            model=model,
            gateway_port=0,
            gateways=2,
            edge=dataclasses.replace(EDGE, access_log=str(path)),
            prefill_args=("--lease-s", str(LEASE_S)),
        )
        log(f"kill: 1P1D ({REAL}), 2 gateways behind Envoy, a kill every {every} s")
        with Mesh(spec) as mesh:
            outcomes, kills = asyncio.run(_kill_in_turn(mesh, vocab, seconds, every))
            leaked = kv_settled(mesh, LEASE_S + 10)
            retries = _envoy_counter(mesh.envoy, "cluster.gateway_grpc.upstream_rq_retry")
        entries = access_log(path)  # whole once Envoy stopped (it flushes every 10 s, and at exit)
    lost_other, reset, retried, unlogged = [], [], 0, 0
    for o in outcomes:
        entry = entries.get(o.request_id)
        unlogged += entry is None
        if not o.whole:
            (reset if _on_killed(o, entry, kills) else lost_other).append(o)
        elif int((entry or {}).get("attempts") or 1) > 1:
            retried += 1
    out = {
        "gateway_kill_lost_requests_other_gateways": len(lost_other),
        "gateway_kill_leaked_blocks": sum(leaked.values()),
        "gateway_kill": {
            "engine": f"{REAL}, 1P1D, prefill KV lease {LEASE_S} s",
            "gateways": 2,
            "kills": len(kills),
            "every_s": every,
            "restarted": "at once, on the same ports",
            "requests": len(outcomes),
            "whole": sum(o.whole for o in outcomes),
            "killed_gateways_begun_streams_reset": len(reset),
            "reset_codes": dict(collections.Counter(o.code for o in reset)),
            "retried_by_envoy_whole": retried,
            "envoy_upstream_retries": retries,
            "not_in_access_log": unlogged,
            "lost_on_other_gateways": [dataclasses.asdict(o) for o in lost_other[:5]],
            "kv_in_use_after": leaked,
        },
    }
    log(f"kill: {out}")
    return out


async def _etcd_kill_under_load(mesh: Mesh, cluster: EtcdCluster, vocab: int, seconds: float):
    stop = asyncio.Event()
    running = asyncio.create_task(ClosedLoop(mesh.gateway_address, vocab).run(stop))
    await asyncio.sleep(seconds / 3)
    await asyncio.to_thread(cluster.kill, 0)
    log("etcd: member 0 (the leader, the one every process talks to first) SIGKILLed")
    await asyncio.sleep(seconds * 2 / 3)
    stop.set()
    return await running


def etcd_part(seconds: float) -> dict:
    model = default_model("tiny")
    vocab = ModelConfig.from_dir(model).vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        cluster = EtcdCluster(Path(tmp))
        try:
            cluster.wait_led(cluster.clients)
            spec = MeshSpec(
                model=model,
                gateway_port=0,
                etcd=EtcdConfig.parse(",".join(cluster.clients)),
                prefill_args=("--lease-s", str(LEASE_S)),
            )
            log(f"etcd: 1P1D ({REAL}) on a 3-member etcd; its leader killed under load")
            with Mesh(spec) as mesh:
                cluster.make_leader(0)
                outcomes = asyncio.run(_etcd_kill_under_load(mesh, cluster, vocab, seconds))
                alive = cluster.clients[1:]
                cluster.wait_led(alive, 15)
                keys = cluster.ctl("get", "--prefix", "--keys-only", "/distserve/", endpoints=alive)
                names = {p.name for p in mesh.workers}
                in_etcd = sorted(names & {k.rsplit("/", 1)[-1] for k in keys.split()})
                listed = sorted(mesh.worker_loads())
                leaked = kv_settled(mesh, LEASE_S + 10)
        finally:
            cluster.stop()
    lost = [o for o in outcomes if not o.whole]
    out = {
        "etcd_member_kill_lost_requests": len(lost),
        "etcd_member_kill": {
            "engine": f"{REAL}, 1P1D, one gateway",
            "killed": "member 0 (the clients' first), made the leader first; not restarted",
            "requests": len(outcomes),
            "lost": [dataclasses.asdict(o) for o in lost[:5]],
            "workers_in_etcd_after": in_etcd,
            "workers_in_gateway_view_after": listed,
            "kv_in_use_after": leaked,
        },
    }
    log(f"etcd: {out}")
    return out
