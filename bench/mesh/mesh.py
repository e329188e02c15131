"""Mesh overhead benchmark: what the services add on top of the engine.

In one run on the tiny model (the point is the mesh's own cost, not the model's):
  * TTFT for a 16-token prompt through the mesh (client -> gateway -> prefill -> client) beside
    the in-process engine (add_request + one prefill step, one torch thread like a pinned
    worker; one engine request after each mesh request, so both see the same host),
    sequential requests (after 20 uncounted ones, here and below), p50 and p99: for 2-token
    requests (the handoff then runs while the first token travels, on the same two cores) and
    for 1-token requests (the path alone). Also against the engine alone (the same requests
    back to back before the mesh starts: hot caches, nothing else running), the stricter
    baseline (`ttft_added_ms_p50_vs_engine_alone`);
  * the handoff: the first inter-token gap through the mesh (KV pulled over UCX, decode joins)
    beside the in-process engine's first decode step;
  * streamed tokens/s through one gateway with 64 concurrent requests, beside the in-process
    engine running the same 64 requests;
  * the edge: TTFT through Envoy beside straight to the gateway (p50, p99), requests alternating
    between the two paths so that both see the same machine, over gRPC and over the HTTP API
    (SSE); and streamed tokens/s through Envoy with 64 concurrent streams, gRPC and SSE.
The mesh is 1 prefill + 1 decode, each pinned to its own core (`--pin`); the gateway, Envoy (one
worker thread, access log to /dev/null, no rate limit) and this client share the machine.
Prints a table and one JSON line. Run: `make bench-mesh`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp
import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distserve.loadgen.probes import WARMUP, grpc_ttft, http_ttft, sequential_ttft_and_gap
from distserve.local_mesh import Mesh, MeshSpec
from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.sampling import SamplingParams
from services.common.stats import percentile
from services.edge.config import EdgeConfig
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.presets import default_model


class EngineProbe:
    """The in-process baseline, one 2-token request per call: TTFT (add_request + the prefill
    step) and the first decode step. Called between the mesh's sequential requests, so that
    the two are measured over the same stretches of a shared, noisy host (run one after the
    other, a slow minute lands on one side only)."""

    def __init__(self, path, prompt: list[int]) -> None:
        self.engine = LLMEngine(path, EngineConfig(num_blocks=256), detokenize=False)
        self.prompt = prompt
        self.params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        self.ttft: list[float] = []
        self.gap: list[float] = []
        self.calls = 0
        for _ in range(WARMUP):
            self()
        self.take()

    def __call__(self) -> None:
        self.calls += 1
        t0 = time.perf_counter()
        self.engine.add_request(self.prompt, self.params, request_id=f"w{self.calls}")
        self.engine.step()
        t1 = time.perf_counter()
        self.engine.step()
        t2 = time.perf_counter()
        self.ttft.append(t1 - t0)
        self.gap.append(t2 - t1)

    def take(self) -> tuple[list[float], list[float]]:
        """The samples since the last take."""
        out = self.ttft, self.gap
        self.ttft, self.gap = [], []
        return out


def engine_stream_rate(path, prompts: list[list[int]], new: int) -> float:
    engine = LLMEngine(path, EngineConfig(num_blocks=2048, max_num_seqs=128))
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    results = engine.generate(prompts, params)
    return sum(len(r.token_ids) for r in results) / (time.perf_counter() - t)


async def mesh_stream_rate(address: str, prompts: list[list[int]], new: int) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        params = common_pb2.SamplingParams(max_tokens=new, ignore_eos=True)

        async def one(p: list[int]) -> int:
            n = 0
            req = gateway_pb2.GenerateRequest(
                token_ids=gateway_pb2.TokenIds(ids=p), sampling=params
            )
            async for r in stub.Generate(req):
                n += len(r.token_ids)
            return n

        t = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return sum(counts) / (time.perf_counter() - t)


async def edge_ttft(mesh: Mesh, prompt: list[int], n: int) -> dict[str, list[float]]:
    """Alternate requests straight to the gateway and through Envoy: TTFT of each path, for
    gRPC and for the HTTP API (2-token requests, as above)."""
    out: dict[str, list[float]] = {"grpc": [], "grpc_edge": [], "http": [], "http_edge": []}
    params = common_pb2.SamplingParams(max_tokens=2, ignore_eos=True)
    request = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=params
    )
    body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True, "stream": True}
    direct = grpc.aio.insecure_channel(mesh.gateway_address)
    edge = grpc.aio.insecure_channel(mesh.edge_address)
    stubs = {
        "grpc": gateway_pb2_grpc.GatewayStub(direct),
        "grpc_edge": gateway_pb2_grpc.GatewayStub(edge),
    }
    urls = {
        "http": f"http://{mesh.gateway_http_address}/v1/completions",
        "http_edge": f"http://{mesh.edge_address}/v1/completions",
    }
    async with aiohttp.ClientSession() as session:
        for i in range(n + WARMUP):
            for name, stub in stubs.items():
                t = await grpc_ttft(stub, request)
                if i >= WARMUP:
                    out[name].append(t)
            for name, url in urls.items():
                t = await http_ttft(session, url, body)
                if i >= WARMUP:
                    out[name].append(t)
    await direct.close()
    await edge.close()
    return out


async def http_stream_rate(address: str, prompts: list[list[int]], new: int) -> float:
    """Streamed tokens/s over the HTTP API (SSE): tokens counted from the final usage."""
    url = f"http://{address}/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(p: list[int]) -> int:
            body = {
                "prompt": p,
                "max_tokens": new,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            used = 0
            async with session.post(url, json=body) as r:
                async for line in r.content:
                    if line.startswith(b'data: {"id"') and b'"usage":{' in line:
                        used = json.loads(line[6:])["usage"]["completion_tokens"]
            return used

        t = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return sum(counts) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100, help="sequential requests for TTFT")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256, help="tokens per streamed request")
    ap.add_argument(
        "--kv-handoff",
        choices=("layerwise", "after-prefill"),
        default="layerwise",
        help="the gateway's handoff (its default: layerwise)",
    )
    args = ap.parse_args()
    path = default_model("tiny")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, 900, (16,), generator=gen).tolist()
    prompts = [
        torch.randint(2, 900, (16,), generator=gen).tolist() for _ in range(args.concurrency)
    ]

    # The in-process baseline runs like a pinned worker: one torch thread.
    torch.set_num_threads(1)
    probe = EngineProbe(path, prompt)
    for _ in range(args.requests):  # back to back, alone: the engine at its hottest
        probe()
    e_alone, _ = probe.take()
    e_rate = engine_stream_rate(path, prompts, args.new_tokens)
    edge = EdgeConfig(port=0, rate_limit_rps=0, access_log="/dev/null")
    spec = MeshSpec(
        model=path,
        gateway_port=0,
        pin=True,
        worker_args=("--kv-cache-gib", "0.0625"),
        gateway_args=("--kv-handoff", args.kv_handoff),
        edge=edge,
    )
    with Mesh(spec) as mesh:
        m_ttft, m_gap = asyncio.run(
            sequential_ttft_and_gap(mesh.gateway_address, prompt, args.requests, between=probe)
        )
        e_ttft, e_gap = probe.take()
        m_ttft1, _ = asyncio.run(
            sequential_ttft_and_gap(
                mesh.gateway_address, prompt, args.requests, max_tokens=1, between=probe
            )
        )
        e_ttft1, _ = probe.take()
        m_rate = asyncio.run(mesh_stream_rate(mesh.gateway_address, prompts, args.new_tokens))
        x = asyncio.run(edge_ttft(mesh, prompt, args.requests))
        x_rate = asyncio.run(mesh_stream_rate(mesh.edge_address, prompts, args.new_tokens))
        x_http_rate = asyncio.run(http_stream_rate(mesh.edge_address, prompts, args.new_tokens))

    ms = 1000
    rows = [
        ("TTFT p50 (ms)", percentile(m_ttft, 50) * ms, percentile(e_ttft, 50) * ms),
        ("TTFT p99 (ms)", percentile(m_ttft, 99) * ms, percentile(e_ttft, 99) * ms),
        ("TTFT p50, engine alone (ms)", percentile(m_ttft, 50) * ms, percentile(e_alone, 50) * ms),
        ("TTFT max_tokens=1 p50 (ms)", percentile(m_ttft1, 50) * ms, percentile(e_ttft1, 50) * ms),
        ("TTFT max_tokens=1 p99 (ms)", percentile(m_ttft1, 99) * ms, percentile(e_ttft1, 99) * ms),
        ("first gap p50 (ms)", percentile(m_gap, 50) * ms, percentile(e_gap, 50) * ms),
        ("first gap p99 (ms)", percentile(m_gap, 99) * ms, percentile(e_gap, 99) * ms),
        (f"tokens/s, {args.concurrency} streams", m_rate, e_rate),
    ]
    print(
        f"\nmesh benchmark: tiny preset, 1P1D pinned, in-process baseline on 1 thread, "
        f"{args.requests} sequential requests, {args.concurrency} x {args.new_tokens} tokens"
    )
    print(f"{'measure':<28}{'mesh':>12}{'in-process':>12}{'added':>10}")
    for name, m, e in rows:
        print(f"{name:<28}{m:>12.2f}{e:>12.2f}{m - e:>10.2f}")
    edge_rows = [
        ("TTFT gRPC p50 (ms)", percentile(x["grpc_edge"], 50) * ms, percentile(x["grpc"], 50) * ms),
        ("TTFT gRPC p99 (ms)", percentile(x["grpc_edge"], 99) * ms, percentile(x["grpc"], 99) * ms),
        (
            "TTFT HTTP SSE p50 (ms)",
            percentile(x["http_edge"], 50) * ms,
            percentile(x["http"], 50) * ms,
        ),
        (
            "TTFT HTTP SSE p99 (ms)",
            percentile(x["http_edge"], 99) * ms,
            percentile(x["http"], 99) * ms,
        ),
        (f"tokens/s gRPC, {args.concurrency} streams", x_rate, m_rate),
    ]
    print(f"\n{'the edge':<28}{'via Envoy':>12}{'direct':>12}{'added':>10}")
    for name, via, direct in edge_rows:
        print(f"{name:<28}{via:>12.2f}{direct:>12.2f}{via - direct:>10.2f}")
    print(f"{f'tokens/s SSE, {args.concurrency} streams':<28}{x_http_rate:>12.2f}")
    result = {
        "bench": "mesh",
        "preset": "tiny",
        "kv_handoff": args.kv_handoff,
        "ttft_ms_p50": round(percentile(m_ttft, 50) * ms, 3),
        "ttft_ms_p99": round(percentile(m_ttft, 99) * ms, 3),
        "engine_ttft_ms_p50": round(percentile(e_ttft, 50) * ms, 3),
        "ttft_added_ms_p50": round((percentile(m_ttft, 50) - percentile(e_ttft, 50)) * ms, 3),
        "ttft_added_ms_p99": round((percentile(m_ttft, 99) - percentile(e_ttft, 99)) * ms, 3),
        "engine_alone_ttft_ms_p50": round(percentile(e_alone, 50) * ms, 3),
        "ttft_added_ms_p50_vs_engine_alone": round(
            (percentile(m_ttft, 50) - percentile(e_alone, 50)) * ms, 3
        ),
        "ttft_added_ms_p50_max_tokens_1": round(
            (percentile(m_ttft1, 50) - percentile(e_ttft1, 50)) * ms, 3
        ),
        "handoff_gap_ms_p50": round(percentile(m_gap, 50) * ms, 3),
        "handoff_added_ms_p50": round((percentile(m_gap, 50) - percentile(e_gap, 50)) * ms, 3),
        "stream_tokens_per_s_64": round(m_rate, 1),
        "engine_tokens_per_s_64": round(e_rate, 1),
        "envoy_ttft_ms_p50": round(percentile(x["grpc_edge"], 50) * ms, 3),
        "direct_ttft_ms_p50": round(percentile(x["grpc"], 50) * ms, 3),
        "envoy_added_ms_p50": round(
            (percentile(x["grpc_edge"], 50) - percentile(x["grpc"], 50)) * ms, 3
        ),
        "envoy_added_ms_p99": round(
            (percentile(x["grpc_edge"], 99) - percentile(x["grpc"], 99)) * ms, 3
        ),
        "envoy_added_ms_p50_http": round(
            (percentile(x["http_edge"], 50) - percentile(x["http"], 50)) * ms, 3
        ),
        "envoy_added_ms_p99_http": round(
            (percentile(x["http_edge"], 99) - percentile(x["http"], 99)) * ms, 3
        ),
        "http_ttft_ms_p50": round(percentile(x["http"], 50) * ms, 3),
        "envoy_stream_tokens_per_s_64": round(x_rate, 1),
        "envoy_http_stream_tokens_per_s_64": round(x_http_rate, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
