"""Where disaggregation pays on this machine: simulated goodput per core, colocated against the
best prefill:decode split, at the 2 cores of the measured comparison (`bench/goodput/goodput.py`)
and at more cores than this host has.

On 2 cores the only disaggregated placement is 1 prefill + 1 decode; DistServe's gain on a
chat-like workload comes partly from choosing the ratio. This asks the planner's simulator,
fed this host's profile of the `small` model, what each placement would serve:

* profile: `--profile FILE` (the planner's format), else measured at the start as a `--pin`
  worker runs (one process pinned to one core, one torch thread; the profiler's quick grid,
  about 3 minutes);
* workloads: `bench/goodput/goodput.py`'s CPU-scaled chat, code and summarisation
  (`distserve.loadgen.goodput.SCALED`), Poisson arrivals;
* instances: the engine options of `bench/goodput/goodput.py`'s workers (`WORKER_ARGS`: a 384 MB KV
  pool, 16 seats, 2048-token prefill batches); KV moves at `--bandwidth` (default 6 GB/s, what
  a 64 MiB pull over UCX shared memory achieves on this host: `make bench-kvtransfer`) and,
  for prompts of >= 256 tokens, beside their prefill (the gateway's default
  `--layerwise-min-tokens`);
* SLOs: the rule of `bench/goodput/goodput.py` predicted from the profile (5x the median request's
  prefill, 3x its batch-1 decode step), and that rule scaled by each `--slo-scales` factor
  (DistServe's Figure 8 varies the SLO the same way);
* goodput: the highest rate with >= 90% of requests meeting both SLOs (the planner's
  bisection, >= 1000 simulated requests per probe), per core; for N cores, colocated xN
  against every split P + D = N, the best reported.

Not modelled (so read the 2-core row beside the measured one): the gateway, the load generator
and the kvtransfer threads, which share the two cores with the workers on this host.

Prints one table per workload and, last, one JSON line.

    .venv/bin/python bench/goodput/goodput_sim.py [--profile FILE] [--cores 2,3,4,6,8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distserve.loadgen.fidelity import profile_pinned
from distserve.loadgen.goodput import SCALED
from distserve.loadgen.report import cpu_model
from services.common import latency as latency_file
from services.common.latency import LatencyModel
from services.common.model_config import ModelConfig
from services.common.slo import Slo
from services.engine.presets import default_model
from services.planner.goodput import goodput
from services.planner.simulator import Instance, SimCluster
from services.planner.workload import Workload

# The engine options of bench/goodput/goodput.py's workers
# (distserve.loadgen.comparison.WORKER_ARGS).
KV_MB = 384
MAX_NUM_SEQS = 16
MAX_BATCH_TOKENS = 2048
LAYERWISE_MIN_TOKENS = 256  # the gateway's default
ALPHA = 0.9
# bench/goodput/goodput.py's rule (distserve.loadgen.goodput.slo_from_unloaded)
TTFT_SLO_FACTOR = 5.0
TPOT_SLO_FACTOR = 3.0


def slo_rule(latency: LatencyModel, workload: Workload) -> Slo:
    """bench/goodput/goodput.py's SLO rule, predicted: 5x the median request's prefill, 3x its
    decode step alone at its mid-output context."""
    reqs = workload.sample(1000, seed=0)
    p, o = float(np.median(reqs.prompt)), float(np.median(reqs.output))
    lat = latency.at(1)
    ttft = lat.prefill_ms(p, p * p) / 1000
    tpot = lat.decode_ms(1, p + o / 2) / 1000
    return Slo(TTFT_SLO_FACTOR * ttft, TPOT_SLO_FACTOR * tpot)


def cluster(
    latency: LatencyModel,
    kv_bytes_per_token: int,
    bandwidth: float,
    *,
    prefill: int = 0,
    decode: int = 0,
    colocated: int = 0,
) -> SimCluster:
    """Instances with the bench workers' engine options, on one host."""
    kv_tokens = KV_MB * 2**20 // kv_bytes_per_token
    return SimCluster(
        instances=(
            *[
                Instance("prefill", max_batch_tokens=MAX_BATCH_TOKENS, max_batch_size=MAX_NUM_SEQS)
                for _ in range(prefill)
            ],
            *[
                Instance("decode", kv_capacity=kv_tokens, max_num_seqs=MAX_NUM_SEQS)
                for _ in range(decode)
            ],
            *[
                Instance(
                    "colocated",
                    kv_capacity=kv_tokens,
                    max_batch_tokens=MAX_BATCH_TOKENS,
                    max_num_seqs=MAX_NUM_SEQS,
                )
                for _ in range(colocated)
            ],
        ),
        latency=latency,
        kv_bytes_per_token=kv_bytes_per_token,
        intra_node_bandwidth=bandwidth,
        layerwise_min_tokens=LAYERWISE_MIN_TOKENS,
    )


def compare(
    latency: LatencyModel,
    workload: Workload,
    slo: Slo,
    cores: int,
    kv_bytes_per_token: int,
    bandwidth: float,
) -> dict:
    """Colocated x`cores` against every prefill + decode split of `cores`: goodput per core."""

    def per_core(**roles: int) -> float:
        c = cluster(latency, kv_bytes_per_token, bandwidth, **roles)
        return goodput(c, workload, slo, ALPHA).rate / cores

    colocated = per_core(colocated=cores)
    splits = {f"{p}P{cores - p}D": per_core(prefill=p, decode=cores - p) for p in range(1, cores)}
    best = max(splits, key=splits.get)
    return {
        "cores": cores,
        "colocated_per_core_rps": round(colocated, 4),
        "splits_per_core_rps": {k: round(v, 4) for k, v in splits.items()},
        "best_split": best,
        "best_per_core_rps": round(splits[best], 4),
        "ratio": round(splits[best] / colocated, 3) if colocated else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--profile", type=Path, help="a profile of the small model (default: measure)"
    )
    parser.add_argument("--cores", default="2,3,4,6,8")
    parser.add_argument("--slo-scales", default="0.5,1,2")
    parser.add_argument(
        "--slo", help="TTFT_MS,TPOT_MS instead of the rule (e.g. a measured run's, to compare)"
    )
    parser.add_argument("--workloads", default="summarization,chat,code")
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=6e9,
        help="KV pull bytes/s (default: a 64 MiB pull over UCX shared memory on this host)",
    )
    parser.add_argument("--save-profile", type=Path, help="write the measured profile here")
    args = parser.parse_args()
    start = time.monotonic()
    model = default_model("small")
    if args.profile is None:
        print("profiling the small model on one pinned core (quick grid) ...", flush=True)
        raw = profile_pinned(model, "quick")
        path = args.save_profile or Path(os.environ.get("TMPDIR", "/tmp")) / "small-profile.json"
        path.write_text(json.dumps(raw))
        args.profile = path
    latency = latency_file.load(args.profile)
    kv_bytes = ModelConfig.from_dir(model).kv_bytes_per_token(4)  # float32 on CPU
    cores = [int(n) for n in args.cores.split(",")]
    scales = [float(s) for s in args.slo_scales.split(",")]
    rows: dict[str, list[dict]] = {}
    for name in args.workloads.split(","):
        workload = SCALED[name]
        base = Slo.parse(args.slo) if args.slo else slo_rule(latency, workload)
        rows[name] = []
        what = "given" if args.slo else "rule"
        print(f"\n{name}: SLO {what} {base.ttft_s * 1000:.0f} / {base.tpot_s * 1000:.1f} ms")
        print(
            f"{'SLO scale':>9} {'cores':>5} {'colocated/core':>14} {'best split':>10} "
            f"{'split/core':>10} {'ratio':>6}   all splits (req/s per core)"
        )
        for scale in scales:
            slo = Slo(base.ttft_s * scale, base.tpot_s * scale)
            for n in cores:
                row = compare(latency, workload, slo, n, kv_bytes, args.bandwidth)
                row["slo_scale"] = scale
                row["slo_ms"] = [round(slo.ttft_s * 1000, 1), round(slo.tpot_s * 1000, 2)]
                rows[name].append(row)
                splits = " ".join(f"{k} {v:.3f}" for k, v in row["splits_per_core_rps"].items())
                print(
                    f"{scale:>9g} {n:>5} {row['colocated_per_core_rps']:>14.3f} "
                    f"{row['best_split']:>10} {row['best_per_core_rps']:>10.3f} "
                    f"{row['ratio'] or 0:>5.2f}x   {splits}",
                    flush=True,
                )
    fit = latency.fit_error
    summary = {
        "bench": "goodput_sim",
        "model": "small",
        "profile": str(args.profile),
        "profile_fit_error": fit,
        "cpu_count": os.cpu_count(),
        "cpu": cpu_model(),
        "bandwidth_bytes_per_s": args.bandwidth,
        "alpha": ALPHA,
        "seconds": round(time.monotonic() - start, 1),
        "workloads": rows,
        **{
            f"sim_ratio_{name}_2cores": next(
                r["ratio"] for r in rows[name] if r["cores"] == 2 and r["slo_scale"] == 1.0
            )
            for name in rows
            if any(r["cores"] == 2 and r["slo_scale"] == 1.0 for r in rows[name])
        },
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
