"""An open-loop load generator against the mesh's public endpoint (gRPC `Generate` or the
OpenAI-compatible HTTP `/v1/completions`, through Envoy or straight to the gateway).

    requests = load_requests(workload.sample(200, seed=1).at_rate(4.0), vocab_size=1024)
    result = asyncio.run(run_load(GrpcTarget("127.0.0.1:8080"), requests))
    result.attainment(Slo(ttft_s=0.2, tpot_s=0.05)); result.summary()
"""

from services.loadgen.requests import LoadRequest, load_requests
from services.loadgen.results import LoadResult, RequestRecord
from services.loadgen.runner import run_load
from services.loadgen.targets import GrpcTarget, HttpTarget, Target

__all__ = [
    "GrpcTarget",
    "HttpTarget",
    "LoadRequest",
    "LoadResult",
    "RequestRecord",
    "Target",
    "load_requests",
    "run_load",
]
