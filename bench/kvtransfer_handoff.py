"""The KV transfer bench's handoff on a real model (`bench/kvtransfer.py`): a prompt prefilled by
a Prefill call, then decoded with its KV handle by a Decode call, which reports the pull."""

from __future__ import annotations

import statistics

import numpy as np

from bench.common import log


async def prefill_and_pull(prefill, decode, prompt: list[int], request_id: str) -> tuple:
    """Prefill one prompt, then decode it with its KV handle (direct Prefill and Decode calls:
    the pull starts when prefill has returned): prefill compute ms, pull ms, KV bytes."""
    from services.common.gen.distserve.v1 import common_pb2, decode_pb2, prefill_pb2

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


async def handoff(address_prefill: str, address_decode: str, lengths: list[int]) -> dict:
    import grpc

    from services.common.gen.distserve.v1 import decode_pb2_grpc, prefill_pb2_grpc

    out = {}
    async with (
        grpc.aio.insecure_channel(address_prefill) as pch,
        grpc.aio.insecure_channel(address_decode) as dch,
    ):
        prefill = prefill_pb2_grpc.PrefillStub(pch)
        decode = decode_pb2_grpc.DecodeStub(dch)
        rng = np.random.default_rng(1)
        for n in lengths:
            rows = []
            for i in range(3):
                prompt = rng.integers(2, 900, n).tolist()
                rows.append(await prefill_and_pull(prefill, decode, prompt, f"h{n}-{i}"))
            compute = statistics.median(r[0] for r in rows)
            pulled = statistics.median(r[1] for r in rows)
            out[n] = {"prefill_ms": compute, "pull_ms": pulled, "kv_bytes": rows[0][2]}
            log(f"handoff {n} tokens: prefill {compute:.0f} ms, pull {pulled:.1f} ms")
    return out
