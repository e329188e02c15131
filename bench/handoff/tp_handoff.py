"""KV handoff between tensor-parallel instances: each decode rank pulls the heads it owns from
the prefill rank(s) that hold them, against a tp=1 -> tp=1 handoff.

Four 1 prefill + 1 decode meshes at once on the `small` preset (12 layers, GQA 12/4, fp32, one
torch thread a rank), identical but for the instances' `--tensor-parallel-size`: P1-D1 (the
baseline), P2-D1 (the decode instance pulls 2 heads from each prefill rank), P1-D2 (each decode
rank pulls its 2 heads of the one source: the source copies the sub-range) and P2-D2 (rank r
pulls from rank r, in place on both sides, the two ranks at once). The gateway hands off after
prefill, so the pull is measured alone. Requests of 4 tokens, one at a time, rotating over the
meshes; reported per prompt length: the mean pull time from the decode instance's
`distserve_kv_transfer_seconds` (rank 0 waits for every rank's pull) and the medians of the
client's first inter-token gap (which contains the pull). All meshes share this host's cores,
so the figures compare the paths, not tensor parallelism's speed-up.
Run: `python bench/handoff/tp_handoff.py` (about 3 minutes here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.handoff.handoff import decode_metrics
from distserve.loadgen.probes import ttft_and_gap
from distserve.loadgen.report import host
from distserve.local_mesh import Mesh, MeshSpec
from services.engine.presets import default_model

CONFIGS = {"P1-D1": (1, 1), "P2-D1": (2, 1), "P1-D2": (1, 2), "P2-D2": (2, 2)}


def start(model: Path, prefill_tp: int, decode_tp: int) -> Mesh:
    spec = MeshSpec(
        model=model,
        gateway_port=0,
        worker_args=("--kv-cache-gib", "0.25", "--max-num-seqs", "8", "--threads", "1"),
        prefill_args=("--tensor-parallel-size", str(prefill_tp)),
        decode_args=("--tensor-parallel-size", str(decode_tp)),
        # Admission control off: long prompts on a busy 2-core host would be refused.
        gateway_args=("--kv-handoff", "after-prefill", "--admission-ttft-factor", "0"),
    )
    mesh = Mesh(spec)
    mesh.start()
    return mesh


def pull_seconds(mesh: Mesh) -> tuple[float, float]:
    """(sum, count) of the decode instance's pull times."""
    m = decode_metrics(mesh)
    return m["distserve_kv_transfer_seconds_sum"], m["distserve_kv_transfer_seconds_count"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="256,1024")
    ap.add_argument("--requests", type=int, default=5, help="per length and configuration")
    args = ap.parse_args()
    model = default_model("small")
    meshes = {name: start(model, *tps) for name, tps in CONFIGS.items()}
    rows = []
    try:
        for mesh in meshes.values():  # warm-up: connections, UCX endpoints
            asyncio.run(ttft_and_gap(mesh.gateway_address, [5] * 64))
        for n in [int(x) for x in args.lengths.split(",")]:
            prompt = [5 + (i * 7) % 900 for i in range(n)]
            gaps: dict[str, list[float]] = {name: [] for name in meshes}
            before = {name: pull_seconds(mesh) for name, mesh in meshes.items()}
            for _ in range(args.requests):
                for name, mesh in meshes.items():
                    _, gap = asyncio.run(ttft_and_gap(mesh.gateway_address, prompt))
                    gaps[name].append(gap * 1000)
            row = {"prompt_tokens": n, "kv_bytes": n * 12 * 2 * 4 * 64 * 4}
            for name, mesh in meshes.items():
                total, count = pull_seconds(mesh)
                pull = (total - before[name][0]) / (count - before[name][1])
                row[f"pull_ms_{name}"] = round(pull * 1000, 2)
                row[f"first_gap_ms_{name}"] = round(statistics.median(gaps[name]), 2)
            rows.append(row)
    finally:
        for mesh in meshes.values():
            mesh.stop()
    print(f"hardware: {host()}")
    print("model: small preset (12 layers, hidden 768, GQA 12/4, fp32)")
    names = list(CONFIGS)
    print(f"{'prompt':>6} {'KV MB':>6} | pull ms: " + " ".join(f"{n:>7}" for n in names))
    for r in rows:
        pulls = " ".join(f"{r[f'pull_ms_{n}']:>7.1f}" for n in names)
        print(f"{r['prompt_tokens']:>6} {r['kv_bytes'] / 2**20:>6.1f} |          {pulls}")
    print(
        json.dumps(
            {"bench": "tp_handoff", "model": "small", "cpu_count": os.cpu_count(), "rows": rows}
        )
    )


if __name__ == "__main__":
    main()
