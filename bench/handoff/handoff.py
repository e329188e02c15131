"""Layer-wise KV handoff benchmark: how much of the pull hides behind prefill, and what that does
to the handoff bubble (the gap between the first and the second token).

Two 1 prefill + 1 decode meshes on the `small` preset (12 layers, hidden 768, 105M parameters,
fp32; each worker pinned to its own core with one torch thread), identical but for the
gateway's `--kv-handoff`: `layerwise` (decode gets the KV handle when the prompt is scheduled
and pulls each layer as soon as prefill has computed it) and `after-prefill` (the baseline:
the pull starts when prefill has returned). Prompts of 256, 1024 and 2048 tokens keep prefill
compute-bound; requests of 4 tokens, one at a time, alternating between the meshes. Reported
per length, medians: TTFT, the first inter-token gap, the pull's time, and the fraction of the
pull that ran while prefill was still computing (from the decode instance's
`distserve_kv_overlap_fraction`). Prints a table and one JSON line.
Run: `python bench/handoff/handoff.py` (about 3 minutes here).
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

from distserve.loadgen.probes import ttft_and_gap
from distserve.loadgen.report import host
from distserve.local_mesh import Mesh, MeshSpec
from services.engine.presets import default_model

MODES = ("layerwise", "after-prefill")


def start(model: Path, mode: str) -> Mesh:
    spec = MeshSpec(
        model=model,
        gateway_port=0,
        pin=True,
        worker_args=("--kv-cache-gib", "0.5", "--max-num-seqs", "8"),
        gateway_args=("--kv-handoff", mode, "--layerwise-min-tokens", "0"),
    )
    mesh = Mesh(spec)
    mesh.start()
    return mesh


def decode_metrics(mesh: Mesh) -> dict[str, float]:
    [decode] = [p for p in mesh.workers if p.name.startswith("decode")]
    names = ("distserve_kv_overlap_fraction", "distserve_kv_transfer_seconds")
    return {
        s.name: s.value
        for s in decode.metrics()
        if s.name.startswith(names) and s.name.endswith(("_sum", "_count"))
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--requests", type=int, default=7, help="per length and mode")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    model = default_model("small")
    meshes = {mode: start(model, mode) for mode in MODES}
    rows = []
    try:
        for mesh in meshes.values():  # warm-up: connections, UCX endpoints
            asyncio.run(ttft_and_gap(mesh.gateway_address, [5] * 64))
        for n in lengths:
            prompt = [5 + (i * 7) % 900 for i in range(n)]
            got: dict[str, dict[str, list[float]]] = {m: {"ttft": [], "gap": []} for m in MODES}
            pull: dict[str, tuple[float, float]] = {}
            before = {m: decode_metrics(mesh) for m, mesh in meshes.items()}
            for _ in range(args.requests):
                for mode, mesh in meshes.items():
                    ttft, gap = asyncio.run(ttft_and_gap(mesh.gateway_address, prompt))
                    got[mode]["ttft"].append(ttft * 1000)
                    got[mode]["gap"].append(gap * 1000)
            for mode, mesh in meshes.items():
                after = decode_metrics(mesh)
                d = {k: after[k] - before[mode].get(k, 0.0) for k in after}
                count = d["distserve_kv_transfer_seconds_count"]
                pull[mode] = (
                    d["distserve_kv_transfer_seconds_sum"] / count * 1000,
                    d["distserve_kv_overlap_fraction_sum"] / count,
                )
            row = {"prompt_tokens": n, "kv_bytes": n * 12 * 2 * 4 * 64 * 4}
            for mode in MODES:
                key = mode.replace("-", "_")
                row[f"ttft_ms_{key}"] = round(statistics.median(got[mode]["ttft"]), 2)
                row[f"first_gap_ms_{key}"] = round(statistics.median(got[mode]["gap"]), 2)
                row[f"pull_ms_{key}"] = round(pull[mode][0], 2)
                row[f"hidden_fraction_{key}"] = round(pull[mode][1], 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for mesh in meshes.values():
            mesh.stop()
    print()
    print(f"hardware: {host()}")
    print("model: small preset (12 layers, hidden 768, GQA 12/4, 105M parameters, fp32)")
    print(
        f"{'prompt':>6} {'KV MB':>6} | {'first gap ms':>23} | {'pull hidden':>11} | {'TTFT ms':>17}"
    )
    print(f"{'':>6} {'':>6} | {'layerwise':>11} {'after':>11} | {'layerwise':>11} | "
          f"{'layerwise':>9} {'after':>7}")  # fmt: skip
    for r in rows:
        print(
            f"{r['prompt_tokens']:>6} {r['kv_bytes'] / 2**20:>6.1f} | "
            f"{r['first_gap_ms_layerwise']:>11.1f} {r['first_gap_ms_after_prefill']:>11.1f} | "
            f"{r['hidden_fraction_layerwise']:>11.0%} | "
            f"{r['ttft_ms_layerwise']:>9.1f} {r['ttft_ms_after_prefill']:>7.1f}"
        )
    longest = rows[-1]
    print(
        json.dumps(
            {
                "bench": "handoff",
                "model": "small",
                "cpu_count": os.cpu_count(),
                "rows": rows,
                "hidden_fraction": longest["hidden_fraction_layerwise"],
                "first_gap_ratio": round(
                    longest["first_gap_ms_layerwise"] / longest["first_gap_ms_after_prefill"], 3
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
