"""What the tracing bench (`bench/tracing/tracing.py`) does to its meshes and reads from them: the
load offered to all of them at once, their step and TTFT counters, each process's CPU time, and the
counting OTLP receiver the traced one exports to."""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import sys
from pathlib import Path

import grpc

from distserve.loadgen.procfs import cpu_seconds
from distserve.loadgen.scrape import gateway
from distserve.local_mesh import Mesh
from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc


def counters(mesh: Mesh) -> dict[str, float]:
    """What the mesh has counted so far: steps and the sequences in them of its prefill and
    decode workers (`distserve_engine_step_*`), and the gateway's TTFT histogram (sum, count)."""
    out = {}
    for kind in ("prefill", "decode"):
        proc = next(p for p in mesh.workers if p.name.startswith(kind))
        found = {s.name: s.value for s in proc.metrics() if s.labels.get("kind") == kind}
        out[f"{kind}_steps"] = found.get("distserve_engine_step_seconds_count", 0.0)
        out[f"{kind}_seqs"] = found.get("distserve_engine_step_batch_size_sum", 0.0)
    for s in gateway(mesh).metrics():
        if s.name.startswith("gen_ai_server_time_to_first_token_seconds_"):
            key = "ttft_" + s.name.rsplit("_", 1)[1]  # ttft_sum, ttft_count
            out[key] = out.get(key, 0.0) + s.value
    return out


def cpu_by_process(mesh: Mesh) -> dict[str, float]:
    """CPU time (user + system, all threads) each process of the mesh has used so far."""
    return {p.name: cpu_seconds(p.popen.pid) for p in mesh.processes}


async def load_together(
    addresses: dict[str, str],
    prompts: list[list[int]],
    new: int,
    concurrency: int,
    seconds: float,
) -> dict[str, int]:
    """Load every mesh at once for `seconds`: on each, `concurrency` streamed requests in flight
    (a new one starts as one ends, the prompts taken in turn). Per mesh: the tokens that arrived
    within the window. Streams still open at the end are cancelled."""
    params = common_pb2.SamplingParams(max_tokens=new, ignore_eos=True)
    channels = {name: grpc.aio.insecure_channel(a) for name, a in addresses.items()}
    try:
        for channel in channels.values():
            await channel.channel_ready()
        deadline = asyncio.get_running_loop().time() + seconds
        counts = dict.fromkeys(addresses, 0)

        async def client(name: str, stub, taken: itertools.count) -> None:
            try:
                async with asyncio.timeout_at(deadline):
                    while True:
                        ids = gateway_pb2.TokenIds(ids=prompts[next(taken) % len(prompts)])
                        async for r in stub.Generate(
                            gateway_pb2.GenerateRequest(token_ids=ids, sampling=params)
                        ):
                            counts[name] += len(r.token_ids)
            except TimeoutError:
                pass

        clients = []
        for name, channel in channels.items():
            stub, taken = gateway_pb2_grpc.GatewayStub(channel), itertools.count()
            clients += [client(name, stub, taken) for _ in range(concurrency)]
        await asyncio.gather(*clients)
        return counts
    finally:
        for channel in channels.values():
            await channel.close()


class Receiver:
    """The test OTLP receiver (tests/otlp_receiver.py), counting, in a process of its own."""

    def __enter__(self) -> Receiver:
        root = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.otlp_receiver"],
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = json.loads(self.proc.stdout.readline())
        self.endpoint, self.http_endpoint = ready["endpoint"], ready["http_endpoint"]
        self.spans = 0
        return self

    def __exit__(self, *exc) -> None:
        out, _ = self.proc.communicate(input="", timeout=60)
        self.spans = json.loads(out.strip().splitlines()[-1])["spans"] if out.strip() else 0
