"""gRPC servicers of the gateway: the public Generate API and the worker registry."""

from __future__ import annotations

from services.common import clock, telemetry
from services.common.convert import finish_to_pb, logprobs_list_to_pb
from services.common.errors import InvalidRequest
from services.common.gen.distserve.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
)
from services.common.generation_defaults import GenerationDefaults
from services.common.tokenizer import Tokenizer
from services.gateway.events import Done
from services.gateway.prefix_index import CachedBlocks
from services.gateway.registry import Load, Registry
from services.gateway.request import Limits, validate
from services.gateway.router import Router

ROLE_NAMES = {
    common_pb2.WORKER_ROLE_PREFILL: "prefill",
    common_pb2.WORKER_ROLE_DECODE: "decode",
    common_pb2.WORKER_ROLE_COLOCATED: "colocated",
}
ROLE_VALUES = {v: k for k, v in ROLE_NAMES.items()}


# Initial metadata of a Generate call on an emulated mesh: wall seconds per emulated second.
TIME_SCALE_HEADER = "x-distserve-time-scale"


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        router: Router,
        tokenizer: Tokenizer,
        limits: Limits,
        defaults: GenerationDefaults | None = None,
    ) -> None:
        self.router = router
        self.tokenizer = tokenizer
        self.limits = limits
        self.defaults = defaults  # generation_config.json's, for fields a request leaves unset

    async def Generate(self, request, context):
        received = clock.monotonic()
        # Behind Envoy, its x-request-id names the request (as in its access log).
        edge_id = dict(context.invocation_metadata() or ()).get("x-request-id", "")
        req = await validate(
            request, self.tokenizer, self.limits, context.time_remaining(), edge_id, self.defaults
        )
        if clock.scale() != 1.0:  # an emulated mesh: the client reports latencies in its time
            await context.send_initial_metadata(((TIME_SCALE_HEADER, repr(clock.scale())),))
        completion = ended = 0
        events = self.router.generate(req, telemetry.incoming(context), received=received)
        async for out in events:
            completion += len(out.token_ids)
            reason = out.reason if isinstance(out, Done) else None
            reply = gateway_pb2.GenerateResponse(
                request_id=req.request_id,
                token_ids=out.token_ids,
                text=out.text,
                finish_reason=finish_to_pb(reason),
                logprobs=logprobs_list_to_pb(out.logprobs),
                prompt_logprobs=logprobs_list_to_pb(out.prompt_logprobs),
                index=out.index,
            )
            ended += reason is not None
            if ended == req.params.n and reason is not None:  # every choice's, summed
                reply.usage.CopyFrom(
                    common_pb2.Usage(
                        prompt_tokens=len(req.prompt_ids), completion_tokens=completion
                    )
                )
            yield reply


class RegistryServicer(gateway_pb2_grpc.WorkerRegistryServicer):
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def Register(self, request, context):
        role = ROLE_NAMES.get(request.role)
        if role is None or not request.worker_id or not request.address:
            raise InvalidRequest("register with a worker_id, a role and an address")
        load = _load(request.load)
        cache = CachedBlocks(request.prefix_cache_salt, load.kv_block_size)
        cache.apply(True, request.prefix_cache.stored, ())
        self.registry.register(request.worker_id, role, request.address, load, cache)
        return gateway_pb2.RegisterResponse(lease_ms=int(self.registry.lease_s * 1000))

    async def Heartbeat(self, request, context):
        events = request.prefix_cache
        known = self.registry.heartbeat(
            request.worker_id, _load(request.load), (events.reset, events.stored, events.removed)
        )
        return gateway_pb2.HeartbeatResponse(known=known)

    async def Deregister(self, request, context):
        self.registry.deregister(request.worker_id)
        return gateway_pb2.DeregisterResponse()

    async def ListWorkers(self, request, context):
        now, wall = clock.monotonic(), clock.time_s()
        return gateway_pb2.ListWorkersResponse(
            workers=[
                gateway_pb2.WorkerInfo(
                    worker_id=w.worker_id,
                    role=ROLE_VALUES[w.role],
                    address=w.address,
                    load=common_pb2.WorkerLoad(**vars(w.load)),
                    last_heartbeat_unix_ms=int((wall - (now - w.last_seen)) * 1000),
                )
                for w in self.registry.live()
            ]
        )


def _load(pb: common_pb2.WorkerLoad) -> Load:
    return Load(
        queued_prompt_tokens=pb.queued_prompt_tokens,
        running_seqs=pb.running_seqs,
        waiting_seqs=pb.waiting_seqs,
        free_kv_blocks=pb.free_kv_blocks,
        total_kv_blocks=pb.total_kv_blocks,
        pending_pulls=pb.pending_pulls,
        held_kv_handles=pb.held_kv_handles,
        decode_step_ms=pb.decode_step_ms,
        kv_block_size=pb.kv_block_size,
        max_model_len=pb.max_model_len,
    )
