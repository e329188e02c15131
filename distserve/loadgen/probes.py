"""Single requests, timed as a client sees them: TTFT and the first inter-token gap through the
gateway (gRPC, or the HTTP API's SSE), and a prefill then a decode with its KV handle straight
to the workers. The load generator (`run_load`) measures a load; these measure one request at a
time, where a benchmark wants the path's latency alone."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc

from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

# Requests before a measurement that are not counted: a mesh that has just started pays for its
# first requests' connections, allocations and UCX endpoints; users meet a warm one.
WARMUP = 20


def generate_request(prompt: list[int], max_tokens: int) -> gateway_pb2.GenerateRequest:
    """A greedy-length request for `max_tokens` tokens of `prompt` (`ignore_eos`)."""
    return gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )


async def token_times(stub, request) -> tuple[float, list[float]]:
    """Send `request` to a Gateway stub: the start time and each token's arrival time
    (`time.perf_counter`)."""
    start = time.perf_counter()
    times: list[float] = []
    async for r in stub.Generate(request):
        times += [time.perf_counter()] * len(r.token_ids)
    return start, times


def _ttft_and_gap(start: float, times: list[float]) -> tuple[float, float]:
    return times[0] - start, times[1] - times[0] if len(times) > 1 else 0.0


async def ttft_and_gap(address: str, prompt: list[int], max_tokens: int = 4) -> tuple[float, float]:
    """(TTFT, first inter-token gap) in seconds of one request on a fresh channel."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        return _ttft_and_gap(*await token_times(stub, generate_request(prompt, max_tokens)))


async def sequential_ttft_and_gap(
    address: str,
    prompt: list[int],
    n: int,
    max_tokens: int = 2,
    between: Callable[[], None] | None = None,
) -> tuple[list[float], list[float]]:
    """TTFT and first inter-token gap of `n` sequential requests (after WARMUP) on one channel;
    `between` is called after each counted one."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        request = generate_request(prompt, max_tokens)
        ttft, gap = [], []
        for i in range(n + WARMUP):
            first, second = _ttft_and_gap(*await token_times(stub, request))
            if i >= WARMUP:
                ttft.append(first)
                gap.append(second)
                if between is not None:
                    between()
        return ttft, gap


async def grpc_ttft(stub, request) -> float | None:
    """TTFT in seconds of `request` on a Gateway stub (None: no token came)."""
    start, times = await token_times(stub, request)
    return times[0] - start if times else None


async def http_ttft(session, url: str, body: dict) -> float | None:
    """TTFT in seconds of a streamed (SSE) HTTP completion on an aiohttp session: its first
    data event (None: none came)."""
    t0 = time.perf_counter()
    first = None
    async with session.post(url, json=body) as r:
        async for line in r.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
    return first


async def prefill_and_pull(prefill, decode, prompt: list[int], request_id: str) -> tuple:
    """Prefill one prompt, then decode it with its KV handle (direct Prefill and Decode calls:
    the pull starts when prefill has returned): prefill compute ms, pull ms, KV bytes."""
    from services.common.gen.distserve.v1 import decode_pb2, prefill_pb2

    sampling = common_pb2.SamplingParams(max_tokens=2, ignore_eos=True)
    async for event in prefill.Prefill(
        prefill_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling
        ),
        timeout=600,
    ):
        reply = event.done
    request = decode_pb2.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=sampling,
        first_token_id=reply.first_token_id,
        kv=reply.kv,
    )
    pull_ms = None
    async for r in decode.Decode(request, timeout=600):
        pull_ms = pull_ms if pull_ms is not None else r.pull_ms
    return reply.compute_ms, pull_ms, reply.kv.layer_bytes * reply.kv.num_layers
