"""What a per-request feature costs through the mesh: TTFT and streamed tokens/s of requests
with it beside the same requests without it, measured in the same run.

The mesh is 1 prefill + 1 decode of the real engine's tiny default model (each pinned to its
own core), behind one gateway, over gRPC. Requests with and without the feature alternate
(sequentially for TTFT, round by round for tokens/s), so that both see the same stretches of a
shared, noisy host. Every request generates exactly `--new-tokens` tokens (`ignore_eos`; a
feature that constrains the answer must leave room for that many), so tokens/s compares the
same work. Used by logprobs.py and json_schema.py beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distserve.loadgen.report import host
from distserve.local_mesh import Mesh, MeshSpec
from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.stats import percentile
from services.engine.presets import default_model

WARMUP = 5
MS = 1000


def request(prompt: list[int], new: int, extra: dict) -> gateway_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(max_tokens=new, ignore_eos=True, **extra)
    return gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=sampling
    )


async def one(stub, req: gateway_pb2.GenerateRequest, check: Callable) -> tuple[float, int]:
    """(TTFT in seconds, tokens) of one request; `check` asserts each response is as asked."""
    start = time.perf_counter()
    first, tokens = None, 0
    async for r in stub.Generate(req):
        if r.token_ids and first is None:
            first = time.perf_counter() - start
        tokens += len(r.token_ids)
        check(r)
    return first, tokens


async def measure(address: str, prompts: list[list[int]], args, extra: dict, check: Callable):
    """TTFTs (sequential, alternating) and tokens/s (concurrent rounds, alternating) of plain
    requests and of requests with `extra` sampling fields."""
    ttft: dict[str, list[float]] = {"base": [], "feature": []}
    rate: dict[str, list[float]] = {"base": [], "feature": []}
    kinds = {"base": {}, "feature": extra}
    checks = {"base": lambda r: None, "feature": check}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for i in range(WARMUP + args.requests):
            for kind, fields in kinds.items():
                t, _ = await one(stub, request(prompts[0], 2, fields), checks[kind])
                if i >= WARMUP:
                    ttft[kind].append(t)
        batch = prompts[: args.concurrency]
        for _ in range(args.rounds):
            for kind, fields in kinds.items():
                reqs = [request(p, args.new_tokens, fields) for p in batch]
                t0 = time.perf_counter()
                done = await asyncio.gather(*(one(stub, r, checks[kind]) for r in reqs))
                tokens = sum(n for _, n in done)
                assert tokens == len(batch) * args.new_tokens, (kind, tokens)
                rate[kind].append(tokens / (time.perf_counter() - t0))
    return ttft, rate


def run(name: str, what: str, extra: dict, check: Callable, keys: tuple[str, str]) -> dict:
    """Measure one feature; print the table and the JSON line (`keys`: the names of the
    tokens/s ratio and of the added TTFT in it)."""
    ap = argparse.ArgumentParser(description=f"the cost of {what} through a 1P1D mesh")
    ap.add_argument("--requests", type=int, default=100, help="sequential requests per kind")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens per streamed request")
    ap.add_argument("--rounds", type=int, default=5, help="tokens/s rounds per kind")
    args = ap.parse_args()
    import torch

    path = default_model("tiny")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 900, (16,), generator=gen).tolist() for _ in range(64)]
    params = _parameters(path)
    spec = MeshSpec(model=path, gateway_port=0, pin=True, worker_args=("--kv-cache-gib", "0.0625"))
    started = time.time()
    with Mesh(spec) as mesh:
        ttft, rate = asyncio.run(measure(mesh.gateway_address, prompts, args, extra, check))
    p50 = {k: percentile(v, 50) * MS for k, v in ttft.items()}
    p99 = {k: percentile(v, 99) * MS for k, v in ttft.items()}
    tok_s = {k: percentile(v, 50) for k, v in rate.items()}
    hardware = host(torch=True)
    print(
        f"\n{what}: tiny default model ({params / 1e6:.2f}M parameters, real torch engine), "
        f"1P1D pinned, gRPC; {args.requests} sequential 2-token requests per kind, "
        f"{args.rounds} rounds of {args.concurrency} x {args.new_tokens} tokens per kind\n"
        f"hardware: {hardware}"
    )
    print(f"{'measure':<30}{'with':>12}{'without':>12}{'added':>10}")
    print(f"{'TTFT p50 (ms)':<30}{p50['feature']:>12.2f}{p50['base']:>12.2f}"
          f"{p50['feature'] - p50['base']:>10.2f}")  # fmt: skip
    print(f"{'TTFT p99 (ms)':<30}{p99['feature']:>12.2f}{p99['base']:>12.2f}"
          f"{p99['feature'] - p99['base']:>10.2f}")  # fmt: skip
    print(f"{f'tokens/s, {args.concurrency} streams':<30}{tok_s['feature']:>12.1f}"
          f"{tok_s['base']:>12.1f}{tok_s['feature'] / tok_s['base']:>9.3f}x")  # fmt: skip
    result = {
        "bench": name,
        "preset": "tiny",
        "engine": "torch",
        "parameters": params,
        "hardware": hardware,
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
        keys[0]: round(tok_s["feature"] / tok_s["base"], 3),
        keys[1]: round(p50["feature"] - p50["base"], 3),
        "ttft_ms_p50": round(p50["feature"], 3),
        "baseline_ttft_ms_p50": round(p50["base"], 3),
        "ttft_added_ms_p99": round(p99["feature"] - p99["base"], 3),
        "tok_s": round(tok_s["feature"], 1),
        "baseline_tok_s": round(tok_s["base"], 1),
        "wall_s": round(time.time() - started, 1),
    }
    print(json.dumps(result))
    return result


def _parameters(path: Path) -> int:
    """The model's parameter count, from its safetensors headers."""
    from safetensors import safe_open

    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(file, "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                n = 1
                for d in f.get_slice(key).get_shape():
                    n *= d
                total += n
    return total


def _commit() -> str:
    out = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    )
    return out.stdout.strip()
