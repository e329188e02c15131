"""gRPC servicer of the decode service: decode the request, one worker call, encode."""

from __future__ import annotations

from services.common import telemetry
from services.common.convert import finish_to_pb, logprobs_list_to_pb, sampling_from_pb
from services.common.errors import InvalidRequest
from services.common.gen.distserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.common.kv_handle import KvHandle
from services.decode.worker import DecodeWorker
from services.worker.prefix_log import prefix_cache_stats

_ROLES = {"decode": common_pb2.WORKER_ROLE_DECODE, "colocated": common_pb2.WORKER_ROLE_COLOCATED}


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker) -> None:
        self.worker = worker

    async def Decode(self, request, context):
        if not request.request_id:
            # The engine would name the request itself, and its tokens reach nobody.
            raise InvalidRequest("request_id is empty: name the request")
        handle = KvHandle.from_pb(request.kv) if request.HasField("kv") else None
        first = request.first_token_id if request.HasField("first_token_id") else None
        choices = tuple((c.index, c.first_token_id) for c in request.choices)
        if handle is not None and not handle.layerwise and first is None and not choices:
            raise InvalidRequest(
                "a request with a KV handle sent after prefill (not layer-wise) needs "
                "first_token_id (or, for several choices, their first tokens in choices)"
            )
        events = self.worker.generate(
            request.request_id,
            list(request.prompt_token_ids),
            sampling_from_pb(request.sampling),
            first if handle is not None else None,
            handle,
            telemetry.incoming(context),
            choices if handle is not None else (),
        )
        async for event in events:
            yield decode_pb2.DecodeResponse(
                token_ids=event.token_ids,
                finish_reason=finish_to_pb(event.finish_reason),
                queue_ms=event.queue_ms,
                pull_ms=event.pull_ms,
                pull_bytes=event.pull_bytes,
                logprobs=logprobs_list_to_pb(event.logprobs),
                prompt_logprobs=logprobs_list_to_pb(event.prompt_logprobs),
                index=event.index,
            )

    async def Stats(self, request, context):
        return worker_stats(self.worker)


def role_pb(worker: DecodeWorker) -> int:
    return _ROLES[worker.config.role]


def worker_load(worker: DecodeWorker) -> common_pb2.WorkerLoad:
    load = worker.loop.load
    return common_pb2.WorkerLoad(
        queued_prompt_tokens=load.queued_prompt_tokens,
        running_seqs=load.running_seqs,
        waiting_seqs=load.waiting_seqs,
        free_kv_blocks=load.free_blocks,
        total_kv_blocks=load.total_blocks,
        kv_block_size=worker.loop.engine.config.block_size,
        max_model_len=worker.loop.engine.max_model_len,
        pending_pulls=worker.pulling,
        decode_step_ms=load.decode_step_ms,
    )


def worker_stats(worker: DecodeWorker) -> common_pb2.WorkerStats:
    return common_pb2.WorkerStats(
        worker_id=worker.config.worker_id,
        role=role_pb(worker),
        load=worker_load(worker),
        requests_total=worker.requests_total,
        requests_aborted=worker.requests_aborted,
        pulls_total=worker.pulls_total,
        pull_bytes_total=worker.pull_bytes_total,
        pull_bytes_by_rank=worker.pull_bytes_by_rank,
        pulls_failed=worker.pulls_failed,
        chunks_retried=worker.puller.chunks_retried,
        checksum_failures=worker.puller.checksum_failures,
        chunks_unverified=worker.chunks_unverified,
        **prefix_cache_stats(worker.engine, worker.prompt_tokens_reused),
        reconnects=worker.puller.reconnects,
        lease_renewals=worker.puller.lease_renewals,
    )
