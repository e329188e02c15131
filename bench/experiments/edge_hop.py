"""Envoy's own hop: a tiny gRPC call (grpc.health.v1.Health/Check) straight to the gateway and
through Envoy, alternating, on a gateway without workers (so nothing else loads the machine).

Separates what the edge's hop costs from what the mesh's load adds to it (bench/mesh/mesh.py).
`--bare` strips Envoy's filters (keys, rate limit, body limit) and the access log, to see
whether the configuration costs anything; `--concurrency` sets Envoy's worker threads.
Run: `.venv/bin/python bench/experiments/edge_hop.py [--bare] [--concurrency N]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import services.edge.envoy as envoy_process
from distserve.local_mesh import Mesh, MeshSpec
from services.common.stats import percentile
from services.edge.config import EdgeConfig
from services.engine.presets import default_model


def bare(config_of):
    """Wrap the config generator: only the router filter, no access log."""

    def generate(config, gateways):
        c = config_of(config, gateways)
        chain = c["static_resources"]["listeners"][0]["filter_chains"][0]
        manager = chain["filters"][0]["typed_config"]
        manager["http_filters"] = [f for f in manager["http_filters"] if "router" in f["name"]]
        manager["access_log"] = []
        return c

    return generate


async def hop(mesh: Mesh, n: int) -> dict[str, list[float]]:
    channels = {
        "direct": grpc.aio.insecure_channel(mesh.gateway_address),
        "envoy": grpc.aio.insecure_channel(mesh.edge_address),
    }
    stubs = {k: health_pb2_grpc.HealthStub(c) for k, c in channels.items()}
    request = health_pb2.HealthCheckRequest(service="")
    out: dict[str, list[float]] = {k: [] for k in stubs}
    for i in range(n + 20):
        for name, stub in stubs.items():
            t0 = time.perf_counter()
            await stub.Check(request)
            if i >= 20:
                out[name].append((time.perf_counter() - t0) * 1000)
    for c in channels.values():
        await c.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=1, help="Envoy worker threads")
    ap.add_argument("--bare", action="store_true", help="no filters, no access log")
    args = ap.parse_args()
    if args.bare:
        envoy_process.envoy_config = bare(envoy_process.envoy_config)
    edge = EdgeConfig(
        port=0, rate_limit_rps=0, access_log="/dev/null", concurrency=args.concurrency
    )
    spec = MeshSpec(model=default_model("tiny"), prefill=0, decode=0, gateway_port=0, edge=edge)
    with Mesh(spec) as mesh:
        t = asyncio.run(hop(mesh, args.calls))
    result = {
        "bench": "edge_hop",
        "bare": args.bare,
        "envoy_concurrency": args.concurrency,
        "direct_ms_p50": round(percentile(t["direct"], 50), 3),
        "envoy_ms_p50": round(percentile(t["envoy"], 50), 3),
        "envoy_hop_ms_p50": round(percentile(t["envoy"], 50) - percentile(t["direct"], 50), 3),
        "envoy_hop_ms_p99": round(percentile(t["envoy"], 99) - percentile(t["direct"], 99), 3),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
