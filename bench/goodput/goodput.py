"""Goodput per core: disaggregated (1 prefill + 1 decode) against colocated x2 on this host.

For each CPU-scaled workload (`distserve.loadgen.goodput.SCALED`: chat, code, summarization) and
the `small` model (12 layers, 105M parameters, fp32), both meshes run with every worker pinned
to its own core (one torch thread) and the same engine options (`distserve.loadgen.comparison.
WORKER_ARGS`); the SLO is 5x the unloaded TTFT and 3x the unloaded TPOT of the workload's median
request (the smaller of the two modes' for each), alpha 0.9, Poisson arrivals; each mode's
goodput is found by bisection over the rate, 24 seeded requests per probe, at most 5 probes.
Sized for about 20-25 minutes on 2 cores. The gateway and the load generator are not pinned:
they share the two cores with the workers, in both modes alike.

24 requests per probe is a first look, not the steady state: a probe that short ends before a
queue that grows without bound has hurt 10% of its requests, and it overstated colocated chat's
goodput 3x against 80-request probes (`--requests 24` against `--requests 80`). For the
figures, run one workload at a time with more requests (`--workloads chat --requests 80`:
about 23 minutes for chat).

Writes bench-goodput/WORKLOAD/{goodput.json,attainment.png,latency_cdf.png}; prints each
workload's table and, last, one JSON line with every workload's goodput, per core, and ratio.

    .venv/bin/python bench/goodput/goodput.py [--requests 24] [--max-probes 5]
        [--workloads chat,code]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distserve.loadgen.comparison import BenchSpec, describe, run_bench
from distserve.loadgen.report import cpu_model
from services.engine.presets import default_model

WORKLOADS = ("summarization", "chat", "code")
# DistServe's targets on this comparison: disaggregated per-core goodput over colocated's.
TARGETS = {"summarization": 1.5, "chat": 1.2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-probes", type=int, default=5)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--out", type=Path, default=Path("bench-goodput"))
    args = parser.parse_args()
    model = default_model("small")
    rows = {}
    start = time.monotonic()
    for name in args.workloads.split(","):
        t0 = time.monotonic()
        report = run_bench(
            BenchSpec(
                model=model,
                workload=name,
                requests=args.requests,
                max_probes=args.max_probes,
                out=args.out / name,
            )
        )
        print(describe(report), flush=True)
        print(f"({name}: {time.monotonic() - t0:.0f} s)\n", flush=True)
        eq = report.get("equal_load", {})
        rows[name] = {
            "slo_ms": report["slo"],
            **{
                f"{m}_{k}": report["modes"][m][k]
                for m in report["modes"]
                for k in ("goodput_rps", "goodput_per_core_rps")
            },
            "ratio_per_core": report.get("ratio_per_core"),
            "target_ratio": TARGETS.get(name),
            "equal_load_rate_rps": eq.get("rate_rps"),
            "ttft_p90_ms": {m: eq[m]["ttft_p90_ms"] for m in report["modes"] if m in eq},
            "tpot_p99_ms": {m: eq[m]["tpot_p99_ms"] for m in report["modes"] if m in eq},
        }
    summary = {
        "bench": "goodput",
        "model": "small",
        "cpu_count": os.cpu_count(),
        "cpu": cpu_model(),
        "requests_per_probe": args.requests,
        "max_probes": args.max_probes,
        "seconds": round(time.monotonic() - start, 1),
        "workloads": rows,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
