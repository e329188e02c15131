"""The KV handoff under two environments, measured in pairs: which UCX (or other) setting makes
the real handoff faster.

Two 1 prefill + 1 decode meshes of the `small` preset (12 layers, hidden 768, 105M parameters,
fp32; each worker pinned to its own core with one torch thread, as `--pin` deploys them) run at
once, identical but for the environment of their workers (`--a-env`, `--b-env`: `NAME=VALUE`
pairs, comma-separated; empty means the workers' defaults). Prompts of `--tokens` tokens are
prefilled, then decoded with their KV handle (direct Prefill and Decode calls: the pull starts
when prefill has returned), alternating between the meshes, so both see the same moment of a
shared host: sequential runs of one setting, then the other, swing by more than the settings
differ. Reported: each pull's time (admission to KV resident, from the
decode instance) after a warm-up, and the medians. Prints a table and one JSON line.
Run: `python bench/experiments/handoff_env.py --b-env UCX_CMA_MEMORY_INVALIDATE=n` (about 2
minutes here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distserve.loadgen.probes import prefill_and_pull
from distserve.loadgen.report import host
from distserve.local_mesh import Mesh, MeshSpec
from services.common.gen.distserve.v1 import decode_pb2_grpc, prefill_pb2_grpc
from services.engine.presets import default_model


def parse_env(text: str) -> dict[str, str]:
    pairs = [kv for kv in text.split(",") if kv]
    if any("=" not in kv for kv in pairs):
        raise SystemExit(f"--a-env/--b-env take NAME=VALUE pairs, comma-separated: {text!r}")
    return dict(kv.split("=", 1) for kv in pairs)


async def alternate(addresses: dict, pulls: int, tokens: int) -> dict[str, list[float]]:
    channels, stubs = [], {}
    for arm, (p, d) in addresses.items():
        pch, dch = grpc.aio.insecure_channel(p), grpc.aio.insecure_channel(d)
        channels += [pch, dch]
        stubs[arm] = (prefill_pb2_grpc.PrefillStub(pch), decode_pb2_grpc.DecodeStub(dch))
    rng = np.random.default_rng(1)
    out = {arm: [] for arm in stubs}
    try:
        for i in range(pulls + 1):  # the first of each is a warm-up (connections, first pull)
            prompt = rng.integers(2, 900, tokens).tolist()
            for arm in list(stubs) if i % 2 == 0 else list(stubs)[::-1]:
                _, ms, _ = await prefill_and_pull(*stubs[arm], prompt, f"{arm}-{i}")
                if i:
                    out[arm].append(ms)
    finally:
        for channel in channels:
            await channel.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a-env", default="", help="NAME=VALUE,... for arm a (default: none)")
    ap.add_argument("--b-env", default="", help="NAME=VALUE,... for arm b")
    ap.add_argument("--pulls", type=int, default=12, help="per arm, after a warm-up")
    ap.add_argument("--tokens", type=int, default=512, help="prompt length")
    args = ap.parse_args()
    envs = {"a": parse_env(args.a_env), "b": parse_env(args.b_env)}
    model = default_model("small")
    meshes: dict[str, Mesh] = {}
    try:
        for arm, env in envs.items():
            spec = MeshSpec(
                model=model,
                prefill=1,
                decode=1,
                gateway_port=0,
                pin=True,
                worker_args=("--kv-cache-gib", "0.5", "--max-batch-tokens", "4096"),
                env=env,
            )
            meshes[arm] = Mesh(spec).__enter__()
        addresses = {
            arm: tuple(
                next(w.ready["address"] for w in mesh.workers if w.name.startswith(role))
                for role in ("prefill", "decode")
            )
            for arm, mesh in meshes.items()
        }
        pulls = asyncio.run(alternate(addresses, args.pulls, args.tokens))
    finally:
        for mesh in meshes.values():
            mesh.__exit__(None, None, None)

    hardware = host()
    print(f"\nKV handoff, two environments alternated: small (105M, fp32), {args.tokens} tokens")
    print(f"{hardware}; {args.pulls} pulls per arm after a warm-up, pinned 1P1D meshes")
    medians = {arm: statistics.median(v) for arm, v in pulls.items()}
    for arm, values in pulls.items():
        shown = " ".join(f"{v:.1f}" for v in sorted(values))
        print(f"  {arm} {envs[arm] or '(defaults)'}: median {medians[arm]:.1f} ms  [{shown}]")
    print(f"  b / a: {medians['b'] / medians['a']:.3f}")
    result = {
        "bench": "handoff_env",
        "model": "small",
        "tokens": args.tokens,
        "hardware": hardware,
        "env": envs,
        "pull_ms": {arm: [round(v, 2) for v in values] for arm, values in pulls.items()},
        "pull_ms_median": {arm: round(m, 2) for arm, m in medians.items()},
        "b_over_a": round(medians["b"] / medians["a"], 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
