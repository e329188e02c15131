"""Planner benchmark: simulator fidelity, placement search time and simulator speed, on this CPU.

(1) Simulator fidelity: the profile of `fidelity.MODEL` (the tiny preset's architecture, ~11M
    parameters, so that an engine step outweighs the mesh's per-token messaging) measured here
    (pinned, one torch thread, the full grid), the mesh's costs beyond the engine measured on a
    running 1P1D mesh (pinned; distserve/loadgen/fidelity.py and calibration.py state them), then
    the same seeded requests (300 per rate)
    through `simulate_1p1d` and through the mesh with the load generator, at the 4 rates where
    the simulator predicts 90/70/50/30% attainment; SLOs 5x the unloaded TTFT, 3x the unloaded
    TPOT; each rate's requests run through the mesh twice (`--repeats`). Figure: the largest gap
    between predicted attainment and the mean of the mesh's runs. Target: <= 2 pp. Beside it, the
    largest spread between the mesh's own runs of the same requests (`mesh_repeat_max_spread_pp`):
    a gap smaller than that cannot be told from noise.
(2) Placement search for an OPT-175B-sized model on 4 nodes x 8 A100-80GB GPUs (latency scaled
    from DistServe's published OPT-66B profile, chat workload, SLO TTFT 4 s / TPOT 200 ms at 90%,
    25 Gb/s between nodes): wall time of `plan()` (both algorithms and the colocated baseline),
    the search alone (`precision=None`: the reported placements not refined).
    Baseline: DistServe reports under 1.3 minutes for this search; our target is <= 10 s.
(3) Simulator speed: simulated requests per second of `simulate()` on OPT-13B, chat workload, for
    a disaggregated cluster (2 prefill + 2 decode) near its goodput and a colocated one (2
    instances). Target: >= 50,000 requests/s (the disaggregated figure is the headline).

Prints each figure beside its baseline or target, then one JSON line. About 20 minutes on 2
cores (12 with --repeats 1), nearly all of it part (1).
Run: .venv/bin/python bench/planner/planner.py [--requests N] [--targets 0.9,0.7,0.5,0.3]
[--grid quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distserve.loadgen.report import cpu_model
from services.common.latency import for_model
from services.common.model_spec import PRESETS
from services.common.slo import Slo
from services.planner.cluster import ClusterSpec, kv_capacity
from services.planner.placement import PlanSpec, plan
from services.planner.simulator import Instance, SimCluster, simulate
from services.planner.workload import PRESETS as WORKLOADS

PAPER_SEARCH_S = 78.0  # DistServe: "under 1.3 minutes" for OPT-175B
TARGET_SEARCH_S = 10.0
TARGET_SIM_RPS = 50_000
TARGET_FIDELITY_PP = 2.0
FIDELITY_TARGETS = (0.9, 0.7, 0.5, 0.3)
FIDELITY_REQUESTS = 300
FIDELITY_REPEATS = 2


def placement_search() -> tuple[float, dict]:
    model = PRESETS["opt-175b"]
    spec = PlanSpec(
        model=model,
        cluster=ClusterSpec(4, 8),
        workload=WORKLOADS["chat"],
        slo=Slo(4.0, 0.2),
        latency=for_model(model, None),
        colocated_latency=for_model(model, None, "vllm"),
        precision=None,  # the search; bench/planner/seed_spread.py times the refinement too
    )
    start = time.perf_counter()
    result = plan(spec)
    return time.perf_counter() - start, result.to_json()


def simulator_speed(reps: int = 3) -> dict[str, float]:
    model = PRESETS["opt-13b"]
    cluster_spec = ClusterSpec(1, 8)
    capacity = kv_capacity(model, 1, 1, cluster_spec)
    latency = for_model(model, None)
    requests = WORKLOADS["chat"].sample(100_000, 0)
    clusters = {
        "disaggregated_2p2d": (
            SimCluster(
                (Instance("prefill", max_batch_tokens=1024),) * 2
                + (Instance("decode", kv_capacity=capacity),) * 2,
                latency,
                kv_bytes_per_token=model.kv_bytes_per_token,
            ),
            12.0,
        ),
        "colocated_2": (
            SimCluster(
                (Instance("colocated", max_batch_tokens=1024, kv_capacity=capacity),) * 2,
                latency,
                colocated_latency=for_model(model, None, "vllm"),
            ),
            5.0,
        ),
    }
    out = {}
    for name, (cluster, rate) in clusters.items():
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            simulate(cluster, requests.at_rate(rate))
            times.append(time.perf_counter() - start)
        out[name] = len(requests) / statistics.median(times)
    return out


def simulator_fidelity(grid: str, targets: tuple[float, ...], requests: int, repeats: int) -> dict:
    """Predicted vs measured attainment of 1P1D on this machine (part (1))."""
    import tempfile

    from distserve.loadgen import fidelity

    with tempfile.TemporaryDirectory() as tmp:
        model = fidelity.create(Path(tmp) / "model")
        result = fidelity.measure(model, grid, targets, requests, repeats=repeats)
    return result.to_json()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--requests", type=int, default=FIDELITY_REQUESTS, help="per rate, part (1)")
    p.add_argument(
        "--targets",
        default=",".join(map(str, FIDELITY_TARGETS)),
        help="predicted attainments whose rates part (1) runs",
    )
    p.add_argument("--grid", choices=("quick", "full"), default="full", help="profile grid")
    p.add_argument(
        "--repeats",
        type=int,
        default=FIDELITY_REPEATS,
        help="runs of each rate's requests through the mesh, part (1): the gap is to their mean, "
        "and their spread is the mesh's own",
    )
    a = p.parse_args()
    targets = tuple(float(t) for t in a.targets.split(","))
    fid = simulator_fidelity(a.grid, targets, a.requests, a.repeats)
    seconds, plan_json = placement_search()
    speeds = simulator_speed()
    placement = plan_json["placement"]
    print(f"planner benchmark on {cpu_model()} ({os.cpu_count()} CPUs), {platform.platform()}")
    print(
        f"(1) simulator fidelity, fidelity model 1P1D pinned, SLO TTFT {fid['slo_ms'][0]:.1f} "
        f"ms / TPOT {fid['slo_ms'][1]:.2f} ms, {a.requests} requests per rate:"
    )
    for r in fid["rows"]:
        runs = " ".join(f"{m:.1%}" for m in r["measured_runs"])
        print(
            f"    {r['rate_rps']:6.2f} req/s: predicted {r['predicted']:6.1%}  measured "
            f"{r['measured']:6.1%} ({runs})  gap {r['gap_pp']:5.1f} pp  mesh's own spread "
            f"{r['spread_pp']:5.1f} pp"
        )
    print(f"    largest gap {fid['max_gap_pp']:.1f} pp   [target <= {TARGET_FIDELITY_PP:.0f} pp]")
    print(f"    largest spread between the mesh's runs of one rate {fid['max_spread_pp']:.1f} pp")
    print(
        f"(2) placement search, OPT-175B on 4x8: {seconds:.2f} s"
        f"   [paper: < {PAPER_SEARCH_S:.0f} s; target <= {TARGET_SEARCH_S:.0f} s]"
    )
    print(
        f"    chose {placement['algorithm']}: "
        + ", ".join(
            f"{role} tp={p['tp']} pp={p['pp']} x{p['replicas']}"
            for role, p in placement["phases"].items()
        )
        + f"; {placement['goodput_per_gpu_rps']:.3g} req/s per GPU, "
        f"{plan_json['ratio_over_colocated']}x colocated"
    )
    for name, rps in speeds.items():
        print(
            f"(3) simulator, {name}: {rps:,.0f} simulated requests/s"
            f"   [target >= {TARGET_SIM_RPS:,}]"
        )
    result = {
        "bench": "planner",
        "sim_attainment_max_gap_pp": fid["max_gap_pp"],
        "sim_attainment_target_pp": TARGET_FIDELITY_PP,
        "sim_fidelity": fid,
        "sim_fidelity_requests_per_rate": a.requests,
        "sim_fidelity_repeats": a.repeats,
        "mesh_repeat_max_spread_pp": fid["max_spread_pp"],
        "placement_seconds_175b_4x8": round(seconds, 3),
        "placement_baseline_paper_s": PAPER_SEARCH_S,
        "placement_target_s": TARGET_SEARCH_S,
        "placement_175b_4x8": {
            "algorithm": placement["algorithm"],
            "phases": placement["phases"],
            "goodput_per_gpu_rps": placement["goodput_per_gpu_rps"],
            "ratio_over_colocated": plan_json["ratio_over_colocated"],
        },
        "sim_requests_per_s": round(speeds["disaggregated_2p2d"]),
        "sim_requests_per_s_by_cluster": {k: round(v) for k, v in speeds.items()},
        "sim_target_requests_per_s": TARGET_SIM_RPS,
        "model_params": {name: spec.num_params for name, spec in PRESETS.items()},
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
