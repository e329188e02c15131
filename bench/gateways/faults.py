"""What bench/gateways/gateways.py's fault parts share: a closed-loop load that records each
request by its id, a gateway restarted where it was, a 3-member etcd, and the KV left in use.

Every request carries its own `x-request-id` (Envoy keeps a client's, and writes it in its access
log beside the gateway that answered and the attempts it took), so a request is attributed to a
gateway by what Envoy did, not guessed from when it failed.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from distserve.loadgen.requests import FIRST_ORDINARY_ID
from distserve.local_mesh import Mesh, Process
from services.common import mesh_tls, orphan_guard
from services.common.gen.distserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    prefill_pb2_grpc,
)
from services.edge.config import EdgeConfig

EDGE = EdgeConfig(port=0, rate_limit_rps=0, access_log="")  # a bench's load is no abuse


@dataclass
class Outcome:
    """One request as its client saw it (monotonic seconds)."""

    request_id: str
    max_tokens: int
    start: float
    end: float = float("nan")
    tokens: int = 0
    code: str = "OK"
    details: str = ""

    @property
    def whole(self) -> bool:
        """It ended OK with every token it asked for (ignore_eos: exactly max_tokens)."""
        return self.code == "OK" and self.tokens == self.max_tokens


@dataclass
class ClosedLoop:
    """`streams` clients, each sending its next request as soon as the last one ended, until
    `stop` is set: prompts of 16-64 random tokens, answers of 64-512 (long enough that a stream
    is mid-answer when something dies)."""

    address: str
    vocab: int
    streams: int = 8
    seed: int = 0
    outcomes: list[Outcome] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> list[Outcome]:
        rng = random.Random(self.seed)
        async with mesh_tls.aio_channel(self.address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)

            async def client(c: int) -> None:
                n = 0
                while not stop.is_set():
                    prompt = [rng.randrange(FIRST_ORDINARY_ID, self.vocab) for _ in range(40)]
                    out = Outcome(f"bench-{c}-{n}", rng.randint(64, 512), time.monotonic())
                    n += 1
                    self.outcomes.append(out)
                    await _one(stub, prompt[: rng.randint(16, 40)], out)

            await asyncio.gather(*(client(c) for c in range(self.streams)))
        return self.outcomes


async def _one(stub: gateway_pb2_grpc.GatewayStub, prompt: list[int], out: Outcome) -> None:
    request = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=out.max_tokens, ignore_eos=True),
    )
    try:
        call = stub.Generate(request, timeout=120, metadata=(("x-request-id", out.request_id),))
        async for reply in call:
            out.tokens += len(reply.token_ids)
    except grpc.aio.AioRpcError as e:
        out.code, out.details = e.code().name, e.details() or ""
    out.end = time.monotonic()


def access_log(path: Path) -> dict[str, dict]:
    """Envoy's JSON access log, by request id (the client's x-request-id)."""
    entries = {}
    for line in path.read_text().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)
            entries[entry.get("request_id", "")] = entry
    return entries


def restart_gateway(mesh: Mesh, dead: Process, timeout_s: float = 60.0) -> Process:
    """Start the gateway `dead` (exited) again with its command line, on the same gRPC and HTTP
    ports (Envoy's upstreams are fixed: a restarted pod keeps its Service); return it once it
    serves, in `dead`'s place in `mesh.processes` (so the mesh stops it)."""
    args = list(dead.popen.args)
    for flag, key in (("--port", "address"), ("--http-port", "http_address")):
        args[args.index(flag) + 1] = dead.ready[key].rpartition(":")[2]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **mesh.spec.env}  # as the mesh starts it
    popen = orphan_guard.popen(
        args, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env
    )
    proc = Process(dead.name, popen)
    threading.Thread(target=_read_ready, args=(proc,), daemon=True).start()
    if not proc.ready_event.wait(timeout_s):
        popen.kill()
        raise TimeoutError(f"{dead.name} did not serve again within {timeout_s} s")
    mesh.processes[mesh.processes.index(dead)] = proc
    return proc


def _read_ready(proc: Process) -> None:
    """Find the ready line; drop the rest (the gateway's log)."""
    for line in proc.popen.stdout:
        if proc.ready is None and line.startswith("{"):
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if event.get("event") == "ready":
                proc.ready = event
                proc.ready_event.set()


def kv_in_use(mesh: Mesh) -> dict[str, int]:
    """Per worker: KV blocks in use and KV handles held (prefill), from its Stats."""
    used = {}
    for p in mesh.workers:
        stub_class = (
            prefill_pb2_grpc.PrefillStub
            if p.name.startswith("prefill")
            else decode_pb2_grpc.DecodeStub
        )
        with grpc.insecure_channel(p.ready["address"]) as channel:
            load = stub_class(channel).Stats(common_pb2.StatsRequest(), timeout=5).load
        used[p.name] = load.total_kv_blocks - load.free_kv_blocks + load.held_kv_handles
    return used


def kv_settled(mesh: Mesh, timeout_s: float) -> dict[str, int]:
    """`kv_in_use` once every worker's is 0, or as it is after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        used = kv_in_use(mesh)
        if not any(used.values()) or time.monotonic() > deadline:
            return used
        time.sleep(0.2)
