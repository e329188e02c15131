"""The gateway tier's figures (issue 49): scaling over gateways, a gateway's and an etcd member's
death under load, and routing quality with several gateways.

Four parts (`--parts`, default all):

* `scaling` (engine: **emulated**, OPT-13B on A100 profiles, time scale 1): one fleet (`--fleet`,
  default 4P4D) with 4 gateways, and for 1, 2 and 4 of them an Envoy in front of those only,
  offered `--rate` requests/s (prompts 32-128, answers 200) for `--seconds`: tokens/s
  delivered per gateway count (`gateway_tokens_per_s_scaling_1_2_4`), the CPU seconds per token
  each serving gateway spent (/proc/PID/stat), the idle gateways', Envoy's, this load
  generator's and the whole host's CPU beside it, and what saturated first. All four gateways run
  throughout (each subscribes to every worker's load feed): one fleet, not three started apart.
* `kill` (engine: **real**, `tiny`, 1P1D, prefill's KV lease 5 s): 2 gateways behind Envoy, 8
  closed-loop streams for `--kill-seconds`; every `--kill-every` s a gateway is SIGKILLed (the
  two in turn) and restarted at once on its ports, as a pod's container is. Each request is
  attributed by Envoy's access log (its x-request-id, the gateway, the attempts):
  `gateway_kill_lost_requests_other_gateways` (target 0) counts requests that did not end whole
  and were not on a gateway at its death; the killed gateway's begun streams (ended with a
  retryable reset) and the requests Envoy retried (the client saw nothing) are counted apart.
  `gateway_kill_leaked_blocks` (target 0): KV blocks in use and handles held on every worker
  once a lease and 10 s have passed after the run.
* `etcd` (engine: **real**, `tiny`, 1P1D, one gateway): a 3-member etcd, every process given all
  three members (member 0 first); the leader is moved to member 0, which is SIGKILLed (not
  restarted: the clients fail over to another member) a third into `--etcd-seconds` of 8
  closed-loop streams: `etcd_member_kill_lost_requests` (target 0), and whether every worker
  was still in etcd and in the gateway's view at the end (past a worker's lease TTL: its lease
  renewed through the rest).
* `routing` (engine: **emulated**, as bench/prefix/prefix.py's routing part, its workload):
  8P2D, `--routing prefix`, behind Envoy with 1 and with 4 gateways:
  `gateway_routing_hit_fraction_ratio_4_vs_1` (prompt tokens reused / the most any prefill
  instance held, 4 gateways over 1; target >= 0.9), and the ratio of the plain cached fraction
  (reused / prompt tokens), which no gateway's view enters.

Prints a line per part and one JSON line with the hardware, the load average before and after
each part (the host is shared), the engine and model per figure. About 20 minutes on a loaded
2-core host.

    .venv/bin/python bench/gateways/gateways.py [--parts scaling,kill,etcd,routing]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gateways.faults import EDGE
from bench.gateways.kill import etcd_part, kill_part
from distserve.loadgen.conversations import (
    ANSWER_AT_SCALE,
    CONVERSATIONS_AT_SCALE,
    RATE,
    SEED,
    Conversations,
    converse,
    prefix_tokens,
)
from distserve.loadgen.emulated import EmulatedCluster, Shape
from distserve.loadgen.procfs import cpu_seconds, host_cpu_seconds
from distserve.loadgen.report import cpu_model, log
from distserve.loadgen.requests import load_requests
from distserve.loadgen.runner import run_load
from distserve.loadgen.scrape import total
from distserve.loadgen.targets import GrpcTarget
from distserve.local_mesh import Mesh
from services.common import mesh_tls
from services.edge.config import EdgeConfig, Upstream
from services.edge.envoy import Envoy
from services.engine.presets import emulated_model
from services.planner.workload import LengthDist, Workload

PARTS = ("scaling", "kill", "etcd", "routing")
EMULATED = "emulated OPT-13B on A100s (DistServe's profile)"
OUTPUT_TOKENS = 200
ROUTING_SHAPE = Shape(prefill=(8, 1), decode=(2, 1))


def shape_of(fleet: str) -> Shape:
    """ "16P16D" -> Shape(prefill=(16, 1), decode=(16, 1))."""
    p, _, d = fleet.upper().rstrip("D").partition("P")
    if not (p.isdigit() and d.isdigit()):
        raise SystemExit(f"--fleet {fleet!r}: write it as <n>P<m>D, e.g. 16P16D")
    return Shape(prefill=(int(p), 1), decode=(int(d), 1))


def envoy_over(gateways, edge: EdgeConfig = EDGE) -> Envoy:
    """A started Envoy balancing (least request) over `gateways` (mesh `Process`es)."""
    tls = mesh_tls.mesh_tls()
    if tls is not None:
        edge = dataclasses.replace(edge, upstream_tls=tls.paths)
    upstreams = [Upstream(g.ready["address"], g.ready.get("http_address", "")) for g in gateways]
    envoy = Envoy(edge, upstreams, die_with_parent=True)
    envoy.start()
    return envoy


def scaling_part(fleet: str, rate: float, seconds: float) -> dict:
    import asyncio

    cluster = EmulatedCluster.of("opt-13b")
    shape = shape_of(fleet)
    workload = Workload(
        "gateway",
        LengthDist("uniform", low=32, high=128),
        LengthDist("fixed", OUTPUT_TOKENS, 0, OUTPUT_TOKENS, OUTPUT_TOKENS),
    )
    spec = cluster.mesh_spec(shape, emulated_model(cluster.model), 1.0, ready_timeout_s=900)
    spec = dataclasses.replace(spec, gateways=4)
    started = time.monotonic()
    log(f"scaling: starting {shape} ({EMULATED}) with 4 gateways")
    counts: dict[str, dict] = {}
    with Mesh(spec) as mesh:
        up_s = round(time.monotonic() - started)
        log(f"scaling: {shape} up in {up_s} s")
        gateways = mesh.gateways
        for k in (1, 2, 4):
            envoy = envoy_over(gateways[:k])
            try:
                requests = workload.sample(int(rate * seconds), seed=k).at_rate(rate)
                load = load_requests(requests, cluster.model.vocab_size, seed=k)
                pids = [g.popen.pid for g in gateways]
                served0 = [_requests(g) for g in gateways[:k]]
                cpu0 = [cpu_seconds(p) for p in pids]
                envoy0, me0, host0 = (
                    cpu_seconds(envoy.popen.pid),
                    cpu_seconds(os.getpid()),
                    host_cpu_seconds(),
                )
                t0 = time.monotonic()
                result = asyncio.run(run_load(GrpcTarget(envoy.address), load, timeout_s=600))
                wall = time.monotonic() - t0
                cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0, strict=True)]
                tokens = int(result.output_tokens.sum())
                # answers are OUTPUT_TOKENS long (ignore_eos): tokens = requests x that
                served = [_requests(g) - n for g, n in zip(gateways, served0, strict=False)]
                host_cores = (host_cpu_seconds() - host0) / wall
                serving = cpu[:k]
                counts[str(k)] = {
                    "tokens_per_s": round(tokens / result.duration_s),
                    "errors": dict(collections.Counter(e for e in result.error if e)),
                    "tpot_p50_ms": round(float(np.nanmedian(result.tpot_s)) * 1000, 1),
                    "gateways_cpu_us_per_token": round(sum(serving) / tokens * 1e6, 1),
                    "gateway_cpu_us_per_token": [
                        round(c / max(1, n * OUTPUT_TOKENS) * 1e6, 1)
                        for c, n in zip(serving, served, strict=True)
                    ],
                    "gateway_requests": served,
                    "gateway_cpu_cores": [round(c / wall, 3) for c in serving],
                    "idle_gateways_cpu_cores": round(sum(cpu[k:]) / wall, 3),
                    "envoy_cpu_cores": round((cpu_seconds(envoy.popen.pid) - envoy0) / wall, 3),
                    "loadgen_cpu_cores": round((cpu_seconds(os.getpid()) - me0) / wall, 3),
                    "host_cpu_cores": round(host_cores, 2),
                    "saturated_by": _saturated(host_cores, max(serving) / wall),
                }
                log(f"scaling: {k} gateway(s): {counts[str(k)]}")
            finally:
                envoy.stop()
    tokens = [counts[k]["tokens_per_s"] for k in ("1", "2", "4")]
    return {
        "gateway_tokens_per_s_scaling_1_2_4": tokens,
        "gateway_scaling_4_over_1": round(tokens[2] / tokens[0], 2) if tokens[0] else None,
        "gateway_scaling": {
            "engine": f"{EMULATED}, time scale 1",
            "fleet": str(shape),
            "fleet_up_s": up_s,
            "rate_rps": rate,
            "seconds": seconds,
            "per_gateway_count": counts,
        },
    }


def _requests(gateway) -> float:
    """Requests the gateway has answered so far, whatever their status."""
    return total(gateway.metrics(), "distserve_gateway_requests_total")


def _saturated(host_cores: float, gateway_cores: float) -> str:
    if host_cores > 0.9 * os.cpu_count():
        return f"host ({host_cores:.2f} of {os.cpu_count()} cores busy)"
    if gateway_cores > 0.9:
        return "gateway (a core)"
    return "neither"


def routing_part(scale: float) -> dict:
    import asyncio

    cluster = EmulatedCluster.of("opt-13b")
    model = emulated_model(cluster.model)
    runs: dict[str, dict] = {}
    for n in (1, 4):
        spec = cluster.mesh_spec(ROUTING_SHAPE, model, scale, ready_timeout_s=600)
        spec = dataclasses.replace(
            spec,
            gateways=n,
            edge=EDGE,
            gateway_args=(*spec.gateway_args, "--routing", "prefix"),
        )
        log(f"routing: {ROUTING_SHAPE} ({EMULATED}), {n} gateway(s) behind Envoy, scale {scale}")
        with Mesh(spec) as mesh:
            talks = Conversations(CONVERSATIONS_AT_SCALE, cluster.model.vocab_size, SEED)
            turns = asyncio.run(
                converse(mesh.edge_address, talks, RATE, scale, ANSWER_AT_SCALE, SEED)
            )
            counted = prefix_tokens(mesh)
        best, cached = counted["best"], counted["cached"]
        runs[str(n)] = {
            "turns": len(turns),
            "failed": sum(1 for t in turns if t.error),
            "hit_fraction_vs_oracle": round(cached / best, 3) if best else None,
            "gateway_choice_vs_best": round(counted["chosen"] / best, 3) if best else None,
            "cached_fraction": round(cached / max(1.0, cached + counted["computed"]), 3),
        }
        log(f"routing: {n} gateway(s): {runs[str(n)]}")

    def ratio(key: str) -> float | None:
        one, four = runs["1"][key], runs["4"][key]
        return round(four / one, 3) if one and four is not None else None

    return {
        "gateway_routing_hit_fraction_ratio_4_vs_1": ratio("hit_fraction_vs_oracle"),
        "gateway_routing_cached_fraction_ratio_4_vs_1": ratio("cached_fraction"),
        "gateway_routing": {
            "engine": f"{EMULATED}, time scale {scale}",
            "fleet": str(ROUTING_SHAPE),
            "workload": f"bench/prefix's: {CONVERSATIONS_AT_SCALE} conversations at {RATE}/s",
            "per_gateway_count": runs,
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument(
        "--fleet",
        default="4P4D",
        help="scaling: the emulated fleet (16P16D starts on 2 cores in ~4 min, but then loses "
        "requests: the host, not the gateways, gives out)",
    )
    ap.add_argument("--rate", type=float, default=40.0, help="scaling: requests/s offered")
    ap.add_argument("--seconds", type=float, default=10.0, help="scaling: seconds of arrivals")
    ap.add_argument("--kill-seconds", type=float, default=70.0, help="kill: seconds of load")
    ap.add_argument("--kill-every", type=float, default=20.0, help="kill: s between kills")
    ap.add_argument("--etcd-seconds", type=float, default=30.0, help="etcd: seconds of load")
    ap.add_argument("--time-scale", type=float, default=6.0, help="routing: time scale")
    args = ap.parse_args()
    parts = args.parts.split(",")
    if unknown := set(parts) - set(PARTS):
        raise SystemExit(f"--parts: no part {', '.join(sorted(unknown))}; choose from {PARTS}")
    started = time.monotonic()
    out: dict = {"cores": os.cpu_count(), "cpu_model": cpu_model(), "load_average": {}}
    for part in parts:
        before = os.getloadavg()[0]
        if part == "scaling":
            out.update(scaling_part(args.fleet, args.rate, args.seconds))
        elif part == "kill":
            out.update(kill_part(args.kill_seconds, args.kill_every))
        elif part == "etcd":
            out.update(etcd_part(args.etcd_seconds))
        else:
            out.update(routing_part(args.time_scale))
        out["load_average"][part] = [round(before, 2), round(os.getloadavg()[0], 2)]
        print(f"{part}: done; load average {out['load_average'][part]}", flush=True)
    out["seconds"] = round(time.monotonic() - started)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
