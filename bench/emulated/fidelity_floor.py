"""How reproducible `bench/emulated/emulated.py --parts fidelity` can be: the planner's simulator
(no mesh) run on the fidelity workload at the same rates with each arrival moved later by a random
fraction of `--jitter-ms` emulated ms, the jitter a real-time mesh cannot avoid (its processes'
scheduling, GC pauses, gRPC; ~1-2 ms of wall time on a loaded 2-core host, divided by the time
scale). A placement whose attainment moves by points under sub-millisecond jitter is chaotic at that
load: one request on the other side of a step boundary changes the batches after it. That is the
floor under `emulated_repeat_spread_pp` on the same number of requests, whatever the mesh does.

Per placement and rate: the unjittered prediction, the jittered runs' mean and standard
deviation, and what two of them differ by (mean and largest over every pair of `--replicas`
runs). One JSON line: `simulator_jitter_spread_pp_<placement>`, the largest mean pair difference
over the rates. No engine; seconds.

    .venv/bin/python bench/emulated/fidelity_floor.py [--jitter-ms 0.5] [--replicas 10]
        [--requests 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.emulated.emulated import SEED_SLO, SEED_WORKLOAD, TARGETS, planned
from distserve.loadgen.emulated import EmulatedCluster, Shape
from distserve.loadgen.emulated_mesh import rate_for
from distserve.loadgen.report import host, log
from services.planner.simulator import simulate
from services.planner.workload import Requests


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jitter-ms", type=float, default=0.5, help="emulated ms, uniform [0, J)")
    p.add_argument("--replicas", type=int, default=10, help="jittered runs per rate")
    p.add_argument("--requests", type=int, default=200, help="per run (the fidelity bench's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    started = time.time()
    cluster = EmulatedCluster.of("opt-13b")
    result = planned(cluster, 4, SEED_WORKLOAD, SEED_SLO)
    shapes = {"disaggregated": Shape.of(result.placement), "colocated": Shape.of(result.colocated)}
    base = SEED_WORKLOAD.sample(args.requests, args.seed)
    rng = np.random.default_rng(args.seed)
    report: dict = {"engine": "none (the planner's simulator)", "jitter_ms": args.jitter_ms}
    summary = {}
    for mode, shape in shapes.items():
        sim = cluster.sim_cluster(shape)
        rows = []
        for target in TARGETS:
            rate = rate_for(cluster, shape, base, SEED_SLO, target)
            requests = base.at_rate(rate)
            jittered = []
            for _ in range(args.replicas):
                t = requests.arrival_s + rng.uniform(0, args.jitter_ms / 1000, len(requests))
                order = np.argsort(t, kind="stable")
                moved = Requests(t[order], requests.prompt[order], requests.output[order])
                jittered.append(simulate(sim, moved).attainment(SEED_SLO) * 100)
            pairs = [abs(a - b) for i, a in enumerate(jittered) for b in jittered[i + 1 :]]
            row = {
                "rate_rps": rate,
                "predicted_pct": round(simulate(sim, requests).attainment(SEED_SLO) * 100, 2),
                "jittered_mean_pct": round(float(np.mean(jittered)), 2),
                "jittered_sd_pp": round(float(np.std(jittered)), 2),
                # what two runs differ by: the mean over every pair of the jittered runs
                "pair_spread_pp": round(float(np.mean(pairs)), 2),
                "pair_spread_max_pp": round(float(np.max(pairs)), 2),
            }
            log(f"{shape} @ {rate:.2f} req/s: {row}")
            rows.append(row)
        report[mode] = {"shape": str(shape), "rows": rows}
        summary[f"simulator_jitter_spread_pp_{mode}"] = max(r["pair_spread_pp"] for r in rows)
    report["hardware"] = host()
    report["wall_s"] = round(time.time() - started, 1)
    print(json.dumps(report, indent=1))
    print(json.dumps({**summary, "jitter_ms": args.jitter_ms, "replicas": args.replicas}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
