"""An open-loop load generator against the mesh's public endpoint (gRPC `Generate` or the
OpenAI-compatible HTTP `/v1/completions`, through Envoy or straight to the gateway).

    requests = load_requests(workload.sample(200, seed=1).at_rate(4.0), vocab_size=1024)
    result = asyncio.run(run_load(GrpcTarget("127.0.0.1:8080"), requests))
    result.attainment(Slo(ttft_s=0.2, tpot_s=0.05)); result.summary()
"""

import importlib

# Imported on first use, so that `distserve --help` (which registers `bench`) stays instant.
_EXPORTS = {
    "GrpcTarget": "targets",
    "HttpTarget": "targets",
    "Target": "targets",
    "LoadRequest": "requests",
    "load_requests": "requests",
    "LoadResult": "results",
    "RequestRecord": "results",
    "run_load": "runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"distserve.loadgen.{module}"), name)
