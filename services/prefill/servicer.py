"""gRPC servicer of the prefill service: decode the request, one worker call, encode."""

from __future__ import annotations

import asyncio

from services.common import telemetry
from services.common.convert import (
    finish_to_pb,
    logprobs_list_to_pb,
    logprobs_to_pb,
    sampling_from_pb,
)
from services.common.errors import InvalidRequest
from services.common.gen.distserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.prefill.worker import PrefillWorker
from services.worker.prefix_log import prefix_cache_stats


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    async def Prefill(self, request, context):
        if not request.request_id:
            # The engine would name the request itself, and its result reach nobody.
            raise InvalidRequest("request_id is empty: name the request (it names its KV)")
        layerwise = None  # gets the layer-wise handle once the prompt is scheduled
        if request.layerwise and not request.discard_kv:
            layerwise = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(
            self.worker.prefill(
                request.request_id,
                list(request.prompt_token_ids),
                sampling_from_pb(request.sampling),
                request.discard_kv,
                telemetry.incoming(context),
                layerwise,
            )
        )
        delivered = False
        try:
            if layerwise is not None:
                await asyncio.wait({task, layerwise}, return_when=asyncio.FIRST_COMPLETED)
                if layerwise.done():
                    yield prefill_pb2.PrefillEvent(kv=layerwise.result().to_pb())
            result = await task
            reply = prefill_pb2.PrefillResponse(
                request_id=request.request_id,
                first_token_id=result.first_token,
                finish_reason=finish_to_pb(result.finish_reason),
                queue_ms=result.queue_ms,
                compute_ms=result.compute_ms,
                batch_size=result.batch_size,
                batch_tokens=result.batch_tokens,
            )
            if result.handle is not None:
                reply.kv.CopyFrom(result.handle.to_pb())
            if result.first_token_logprobs is not None:
                reply.first_token_logprobs.CopyFrom(logprobs_to_pb(result.first_token_logprobs))
            reply.prompt_logprobs.extend(logprobs_list_to_pb(result.prompt_logprobs))
            for choice in result.other_choices:
                first = reply.other_choices.add(
                    token_id=choice.token, finish_reason=finish_to_pb(choice.finish_reason)
                )
                if choice.logprobs is not None:
                    first.logprobs.CopyFrom(logprobs_to_pb(choice.logprobs))
            yield prefill_pb2.PrefillEvent(done=reply)
            delivered = True
        finally:
            task.cancel()  # the caller left: the worker frees what the request holds
            if layerwise is not None:
                layerwise.cancel()
            if not delivered:
                # The caller left as the prompt finished: nobody will take or release its KV.
                await asyncio.shield(self.worker.abandon(request.request_id))

    async def Abandon(self, request, context):
        freed = await self.worker.abandon(request.request_id)
        return prefill_pb2.AbandonResponse(freed=freed)

    async def Stats(self, request, context):
        return worker_stats(self.worker)


def worker_load(worker: PrefillWorker) -> common_pb2.WorkerLoad:
    load = worker.loop.load
    return common_pb2.WorkerLoad(
        queued_prompt_tokens=load.queued_prompt_tokens,
        waiting_seqs=load.waiting_seqs,
        free_kv_blocks=load.free_blocks,
        total_kv_blocks=load.total_blocks,
        kv_block_size=worker.loop.engine.config.block_size,
        max_model_len=worker.loop.engine.max_model_len,
        held_kv_handles=len(worker.leases),
    )


def worker_stats(worker: PrefillWorker) -> common_pb2.WorkerStats:
    return common_pb2.WorkerStats(
        worker_id=worker.config.worker_id,
        role=common_pb2.WORKER_ROLE_PREFILL,
        load=worker_load(worker),
        requests_total=worker.requests_total,
        requests_aborted=worker.requests_aborted,
        handles_released=worker.leases.released_total,
        leases_expired=worker.leases.expired_total,
        blocks_reclaimed=worker.blocks_reclaimed,
        kv_bytes_served_by_rank=worker.bytes_served_by_rank(),
        **prefix_cache_stats(worker.engine),
    )
