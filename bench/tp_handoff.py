"""KV handoff from a tensor-parallel prefill instance: what gathering each chunk from the ranks
costs against a tp=1 source.

Two 1 prefill + 1 decode meshes on the `small` preset (12 layers, GQA 12/4, fp32, one torch
thread a rank), identical but for the prefill instance's `--tensor-parallel-size`: 1 (the
baseline) and 2 (its KV split by heads over two ranks; every chunk is gathered to rank 0 with
`dist.gather` over gloo before it is sent). The gateway hands off after prefill, so the pull is
measured alone (no overlap with prefill). Requests of 2 tokens, one at a time, alternating
between the meshes; reported per prompt length, medians of the client's TTFT and first
inter-token gap (which contains the pull), and the mean pull time from the decode instance's
`distserve_kv_transfer_seconds`. Both meshes run at once on this host, so the tp=2 prefill
shares the cores with everything else: the figures compare the two paths, they do not show
tensor parallelism's speed-up (that needs a core or a GPU per rank).
Run: `python bench/tp_handoff.py` (about 2 minutes here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.engine.presets import default_model
from services.launcher import Mesh, MeshSpec

DEGREES = (1, 2)


def start(model: Path, tp: int) -> Mesh:
    spec = MeshSpec(
        model=model,
        gateway_port=0,
        worker_args=("--kv-cache-mb", "256", "--max-num-seqs", "8", "--threads", "1"),
        prefill_args=("--tensor-parallel-size", str(tp)),
        # Admission control off: long prompts on a busy 2-core host would be refused.
        gateway_args=("--kv-handoff", "after-prefill", "--admission-ttft-factor", "0"),
    )
    mesh = Mesh(spec)
    mesh.start()
    return mesh


async def request(address: str, prompt: list[int]) -> tuple[float, float]:
    """(TTFT, first inter-token gap) in seconds, as the client sees them."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        req = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True),
        )
        start = time.perf_counter()
        times: list[float] = []
        async for r in stub.Generate(req):
            times += [time.perf_counter()] * len(r.token_ids)
        return times[0] - start, times[1] - times[0]


def pull_seconds(mesh: Mesh) -> tuple[float, float]:
    """(sum, count) of the decode instance's pull times."""
    [decode] = [p for p in mesh.workers if p.name.startswith("decode")]
    body = urllib.request.urlopen(
        f"http://{decode.ready['metrics_address']}/metrics", timeout=5
    ).read()
    samples = {
        s.name: s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
        if s.name.startswith("distserve_kv_transfer_seconds")
    }
    return (
        samples["distserve_kv_transfer_seconds_sum"],
        samples["distserve_kv_transfer_seconds_count"],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="256,1024")
    ap.add_argument("--requests", type=int, default=5, help="per length and degree")
    args = ap.parse_args()
    model = default_model("small")
    meshes = {tp: start(model, tp) for tp in DEGREES}
    rows = []
    try:
        for mesh in meshes.values():  # warm-up: connections, UCX endpoints
            asyncio.run(request(mesh.gateway_address, [5] * 64))
        for n in [int(x) for x in args.lengths.split(",")]:
            prompt = [5 + (i * 7) % 900 for i in range(n)]
            got = {tp: {"ttft": [], "gap": []} for tp in DEGREES}
            before = {tp: pull_seconds(mesh) for tp, mesh in meshes.items()}
            for _ in range(args.requests):
                for tp, mesh in meshes.items():
                    ttft, gap = asyncio.run(request(mesh.gateway_address, prompt))
                    got[tp]["ttft"].append(ttft * 1000)
                    got[tp]["gap"].append(gap * 1000)
            row = {"prompt_tokens": n, "kv_bytes": n * 12 * 2 * 4 * 64 * 4}
            for tp, mesh in meshes.items():
                total, count = pull_seconds(mesh)
                pull = (total - before[tp][0]) / (count - before[tp][1])
                row[f"pull_ms_tp{tp}"] = round(pull * 1000, 2)
                row[f"first_gap_ms_tp{tp}"] = round(statistics.median(got[tp]["gap"]), 2)
                row[f"ttft_ms_tp{tp}"] = round(statistics.median(got[tp]["ttft"]), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for mesh in meshes.values():
            mesh.stop()
    print()
    print(f"hardware: {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}")
    print("model: small preset (12 layers, hidden 768, GQA 12/4, fp32); prefill tp 1 vs 2")
    print(f"{'prompt':>6} {'KV MB':>6} | {'pull ms':>15} | {'first gap ms':>15} | {'TTFT ms':>15}")
    print(
        f"{'':>6} {'':>6} | {'tp1':>7} {'tp2':>7} | {'tp1':>7} {'tp2':>7} | {'tp1':>7} {'tp2':>7}"
    )
    for r in rows:
        print(
            f"{r['prompt_tokens']:>6} {r['kv_bytes'] / 2**20:>6.1f} | "
            f"{r['pull_ms_tp1']:>7.1f} {r['pull_ms_tp2']:>7.1f} | "
            f"{r['first_gap_ms_tp1']:>7.1f} {r['first_gap_ms_tp2']:>7.1f} | "
            f"{r['ttft_ms_tp1']:>7.1f} {r['ttft_ms_tp2']:>7.1f}"
        )


if __name__ == "__main__":
    main()
