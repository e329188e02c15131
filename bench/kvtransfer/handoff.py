"""The KV transfer bench's handoff on a real model (`bench/kvtransfer/kvtransfer.py`): prompts
prefilled by a Prefill call, then decoded with their KV handle by a Decode call, which reports
the pull (`distserve.loadgen.probes.prefill_and_pull`)."""

from __future__ import annotations

import statistics

import numpy as np

from distserve.loadgen.probes import prefill_and_pull
from distserve.loadgen.report import log


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
