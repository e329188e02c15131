"""The mesh at the scale it is for, on the emulated engine: fidelity to the planner's simulator,
goodput of the planner's placements over colocated serving, and one gateway's ceiling.

Engine: **emulated** (docs/engine.md): every process of the mesh is real (gateway, workers, UCX
handoff, leases, batching), each worker's forward pass is its modelled time on an A100 from
DistServe's published profiles, and the mesh runs `--time-scale K` times slower than the wall.
Every latency and rate here is in emulated time. Nothing here is a claim about a model's output
or a kernel's speed (those come from the real engine: bench/engine/engine.py).

Parts (`--parts`, default all):

* `fidelity`: OPT-13B, prompts 512 / outputs 64 (DistServe's seed example), SLO TTFT 400 ms /
  TPOT 40 ms. For colocated x4 and the planner's best disaggregated placement on 4 GPUs, the
  rates where the simulator (the same instances, `distserve.loadgen.emulated`) predicts 95, 80,
  65 and 50% attainment; each rate's requests through the mesh twice. `emulated_fidelity_max_
  gap_pp` (prediction against the mean of the runs), `emulated_repeat_spread_pp` (between runs).
* `opt13b`: the same two meshes' goodput (the highest rate with >= 90% of the middle half of the
  requests meeting both SLOs, as the planner judges it, searched in steps from the simulator's
  goodput on the same requests) per GPU: `emulated_goodput_ratio_opt13b`, the planner's
  predicted ratio beside it.
* The planner's workloads on 8 A100s: bench/emulated/workloads.py (its own 25 minutes).
* `gateway`: 16P16D emulated A100s at their own speed behind one gateway
  (bench/emulated/gateway.py): the most tokens/s it delivers here
  (`gateway_max_tokens_per_s_32_workers`), its CPU per token (`tokens_per_s_per_gateway_core`),
  which saturates first (the gateway or this host), and where its CPU goes (py-spy, top 5).

    .venv/bin/python bench/emulated/emulated.py [--parts fidelity,opt13b,gateway] [--time-scale K]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distserve.loadgen.emulated import EmulatedCluster, Shape, judged
from distserve.loadgen.emulated_mesh import EmulatedMesh, rate_for
from distserve.loadgen.goodput import Probe, step_search
from distserve.loadgen.procfs import rss_bytes
from distserve.loadgen.report import host, log, percentiles, report_and_exit_code
from services.common.slo import Slo
from services.planner.goodput import max_rate
from services.planner.placement import plan
from services.planner.simulator import simulate
from services.planner.workload import LengthDist, Requests, Workload

SEED_WORKLOAD = Workload(
    "prompt=512,output=64",
    LengthDist("fixed", 512, 0, 512, 512),
    LengthDist("fixed", 64, 0, 64, 64),
)
SEED_SLO = Slo(0.4, 0.04)
ALPHA = 0.9
TARGETS = (0.95, 0.8, 0.65, 0.5)


def planned(cluster: EmulatedCluster, gpus: int, workload, slo: Slo):
    """The planner's plan on one node of `gpus` A100s (pp = 1: what the workers implement)."""
    return plan(cluster.plan_spec(gpus, workload, slo, alpha=ALPHA, max_pp=1))


def fidelity(em: EmulatedMesh, base: Requests, slo: Slo, repeats: int) -> list[dict]:
    rows = []
    sim_cluster = em.cluster.sim_cluster(em.shape)
    for target in TARGETS:
        rate = rate_for(em.cluster, em.shape, base, slo, target)
        requests = base.at_rate(rate)
        sim = simulate(sim_cluster, requests)
        runs = [em.run(requests) for _ in range(repeats)]
        measured = [r.attainment(slo) for r in runs]
        row = {
            "rate_rps": rate,
            "predicted": round(sim.attainment(slo), 4),
            "measured_runs": [round(m, 4) for m in measured],
            "gap_pp": round(abs(sim.attainment(slo) - float(np.mean(measured))) * 100, 2),
            "spread_pp": round((max(measured) - min(measured)) * 100, 2),
            "errors": int(sum((~r.ok).sum() for r in runs)),
            "ttft_ms": {
                "sim": percentiles(sim.ttft, scale=1000),
                "mesh": percentiles(runs[0].ttft_s, scale=1000),
            },
            "tpot_ms": {
                "sim": percentiles(sim.tpot, scale=1000),
                "mesh": percentiles(runs[0].tpot_s, scale=1000),
            },
        }
        log(
            f"  {em.shape} @ {rate:.2f} req/s: predicted {row['predicted']:.3f}, "
            f"mesh {row['measured_runs']}, gap {row['gap_pp']} pp"
        )
        rows.append(row)
    return rows


def goodput_on(em: EmulatedMesh, base: Requests, slo: Slo, hint: float, probes: int) -> dict:
    """The mesh's goodput (judged as the planner judges it), searched in steps from the
    simulator's goodput on the same requests and instances (`hint`: the planner's, where the
    search for that starts), with the simulator's attainment of each probe beside it."""
    sim_cluster = em.cluster.sim_cluster(em.shape)
    n = len(base)

    def simulated(rate: float) -> float:  # the middle half, as the mesh's probes are judged
        return simulate(sim_cluster, base.at_rate(rate), n - n // 4).attainment(slo, n // 4)

    predicted = max_rate(lambda r: simulated(r) if r > 0 else 1.0, ALPHA, hint, rel_tol=0.01)
    sims = {}

    def measure(rate: float) -> Probe:
        requests = base.at_rate(rate)
        result = em.run(requests, until=n - n // 4)  # the judged ones ended: enough
        sims[rate] = simulated(rate)
        probe = dataclasses.replace(Probe.of(rate, result, slo), attainment=judged(result, slo))
        log(
            f"  {em.shape} @ {rate:.2f} req/s: attainment {probe.attainment:.3f} "
            f"(simulator {sims[rate]:.3f})"
        )
        return probe

    search = step_search(measure, predicted, probes, ALPHA)
    out = search.to_json()
    out["simulator_goodput_rps"] = round(predicted, 3)
    for p, probe in zip(out["probes"], sorted(search.probes, key=lambda p: p.rate), strict=True):
        p["simulator_attainment"] = round(sims[probe.rate], 4)
    out["per_gpu_rps"] = round(search.goodput / em.shape.devices, 4)
    return out


def compare(
    cluster: EmulatedCluster,
    gpus: int,
    workload,
    slo: Slo,
    parts: set[str],
    args: argparse.Namespace,
    time_scale: float | None = None,
) -> dict:
    """The planner's placement and colocated baseline for (workload, slo) on `gpus` GPUs:
    fidelity rows and/or goodput on the emulated mesh, with the planner's prediction. `args`:
    requests (per run), repeats, probes, seed and time_scale (unless `time_scale` is given)."""
    time_scale = time_scale or args.time_scale
    result = planned(cluster, gpus, workload, slo)
    shapes = {"disaggregated": Shape.of(result.placement), "colocated": Shape.of(result.colocated)}
    base = workload.sample(args.requests, args.seed)
    out = {
        "model": cluster.model.name,
        "workload": workload.name,
        "time_scale": time_scale,
        "slo_ms": [slo.ttft_s * 1000, slo.tpot_s * 1000],
        "predicted": {
            "disaggregated": {
                "shape": str(shapes["disaggregated"]),
                "goodput_rps": round(result.placement.goodput, 3),
                "per_gpu_rps": round(result.placement.per_device, 4),
            },
            "colocated": {
                "shape": str(shapes["colocated"]),
                "goodput_rps": round(result.colocated.goodput, 3),
                "per_gpu_rps": round(result.colocated.per_device, 4),
            },
            "ratio": round(result.ratio, 3),
        },
    }
    hints = {"disaggregated": result.placement.goodput, "colocated": result.colocated.goodput}
    for mode, shape in shapes.items():
        log(f"{workload.name} on {cluster.model.name}, {mode} {shape}:")
        started = time.time()
        with EmulatedMesh(cluster, shape, time_scale) as em:
            rss = [rss_bytes(p.popen.pid) or 0 for p in em.mesh.workers]
            entry = {
                "shape": str(shape),
                "devices": shape.devices,
                "worker_rss_mb_max": round(max(rss) / 2**20, 1),
            }
            if "fidelity" in parts:
                entry["fidelity"] = fidelity(em, base, slo, args.repeats)
            if "goodput" in parts:
                entry["goodput"] = goodput_on(em, base, slo, hints[mode], args.probes)
            # K is large enough when the mesh's own CPU per request is under a tenth of a step
            entry["mesh_cpu_per_request_ms"] = round(em.cpu_per_request_ms(), 3)
            entry["mean_step_ms"] = round(em.mean_step_ms(), 3)
        entry["wall_s"] = round(time.time() - started, 1)
        out[mode] = entry
    if "goodput" in parts:
        d, c = (
            out["disaggregated"]["goodput"]["per_gpu_rps"],
            out["colocated"]["goodput"]["per_gpu_rps"],
        )
        out["measured_ratio"] = round(d / c, 3) if c > 0 else None
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="fidelity,opt13b,gateway")
    p.add_argument("--time-scale", type=float, default=4.0, help="wall s per emulated s")
    p.add_argument("--requests", type=int, default=200, help="per run")
    p.add_argument("--repeats", type=int, default=2, help="runs of each fidelity rate")
    p.add_argument("--probes", type=int, default=4, help="goodput probes per mesh")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the full JSON here too")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    started = time.time()
    report: dict = {
        "engine": "emulated (DistServe's published A100 profiles)",
        "hardware": host(),
        "time_scale": args.time_scale,
    }
    summary: dict = {}
    if parts & {"fidelity", "opt13b"}:
        cluster = EmulatedCluster.of("opt-13b")
        which = {"fidelity"} if "fidelity" in parts else set()
        which |= {"goodput"} if "opt13b" in parts else set()
        seed = compare(cluster, 4, SEED_WORKLOAD, SEED_SLO, which, args)
        report["opt13b_4gpu"] = seed
        if "fidelity" in parts:
            rows = seed["disaggregated"]["fidelity"] + seed["colocated"]["fidelity"]
            summary["emulated_fidelity_max_gap_pp"] = max(r["gap_pp"] for r in rows)
            summary["emulated_repeat_spread_pp"] = max(r["spread_pp"] for r in rows)
        if "opt13b" in parts:
            summary["emulated_goodput_ratio_opt13b"] = seed["measured_ratio"]
            summary["emulated_goodput_ratio_opt13b_predicted"] = seed["predicted"]["ratio"]
    if "gateway" in parts:
        from bench.emulated.gateway import measure

        log("one gateway, 16P16D, short steps:")
        gateway = measure(log)
        report["gateway"] = gateway
        for key in ("gateway_max_tokens_per_s_32_workers", "tokens_per_s_per_gateway_core"):
            summary[key] = gateway[key]
        summary["gateway_saturated_by"] = gateway["saturated_by"]
        summary["gateway_cpu_top5"] = [f["function"] for f in gateway["gateway_cpu_top5"]["own"]]
    meshes = [
        v
        for e in report.values()
        if isinstance(e, dict)
        for v in e.values()
        if isinstance(v, dict) and "mesh_cpu_per_request_ms" in v
    ]
    if meshes:  # K is large enough when the mesh's CPU per request is under a tenth of a step
        worst = max(meshes, key=lambda m: m["mesh_cpu_per_request_ms"] / m["mean_step_ms"])
        summary["mesh_cpu_per_request_emulated_ms"] = worst["mesh_cpu_per_request_ms"]
        summary["mesh_cpu_per_request_over_step"] = round(
            worst["mesh_cpu_per_request_ms"] / worst["mean_step_ms"], 3
        )
    summary["time_scale"] = args.time_scale
    summary["engine"] = "emulated"
    return report_and_exit_code(report, summary, args.out, started)


if __name__ == "__main__":
    sys.exit(main())
