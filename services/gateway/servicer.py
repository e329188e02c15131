"""gRPC servicers of the gateway: the public Generate API and its view of the workers."""

from __future__ import annotations

from services.common import clock, telemetry
from services.common.convert import finish_to_pb, logprobs_list_to_pb
from services.common.discovery import ROLE_VALUES
from services.common.gen.distserve.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
)
from services.common.generation_defaults import GenerationDefaults
from services.common.tokenizer import Tokenizer
from services.gateway.events import Done
from services.gateway.registry import Registry
from services.gateway.request import Limits, validate
from services.gateway.router import Router

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
        completion = 0
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
            )
            if reason is not None:
                reply.usage.CopyFrom(
                    common_pb2.Usage(
                        prompt_tokens=len(req.prompt_ids), completion_tokens=completion
                    )
                )
            yield reply


class RegistryServicer(gateway_pb2_grpc.WorkerRegistryServicer):
    """What this gateway routes to (workers join in the discovery service, not here)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    async def ListWorkers(self, request, context):
        now, wall = clock.monotonic(), clock.time_s()
        return gateway_pb2.ListWorkersResponse(
            workers=[
                gateway_pb2.WorkerInfo(
                    worker_id=w.worker_id,
                    role=ROLE_VALUES[w.role],
                    address=w.address,
                    load=common_pb2.WorkerLoad(**vars(w.load)),
                    last_report_unix_ms=int((wall - (now - w.last_seen)) * 1000),
                )
                for w in self.registry.live()
            ]
        )
