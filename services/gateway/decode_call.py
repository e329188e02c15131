"""A Decode call on one decode or colocated instance, as the gateway's serving paths make it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from services.common import telemetry
from services.common.convert import finish_from_pb, logprobs_list_from_pb, sampling_to_pb
from services.common.gen.distserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.gateway.events import Output, output
from services.gateway.registry import Registry, Worker
from services.gateway.request import Request


@dataclass(frozen=True)
class DecodeCall:
    """A Decode call and the instance serving it (`ticket`: the call in its sent work)."""

    call: grpc.aio.UnaryStreamCall
    worker: Worker
    ticket: int

    @classmethod
    def start(
        cls,
        channel: Callable[[str], grpc.aio.Channel],
        worker: Worker,
        req: Request,
        trace,
        prompt_tokens: int = 0,
        first_token: int | None = None,
        kv: common_pb2.KvHandle | None = None,
        choices: tuple[tuple[int, int], ...] = (),
    ) -> DecodeCall:
        """A Decode call on `worker`: with `kv`, for KV held on a prefill instance
        (`first_token` None: a layer-wise handle, or a request of several choices: `choices`
        are (index, first token) of those to decode); without, the worker prefills the prompt
        itself (`prompt_tokens` of it queue there until it answers)."""
        telemetry.annotate(trace, {"distserve.decode.instance": worker.worker_id})
        call = decode_pb2_grpc.DecodeStub(channel(worker.address)).Decode(
            decode_pb2.DecodeRequest(
                request_id=req.worker_request_id,
                prompt_token_ids=req.prompt_ids,
                sampling=sampling_to_pb(req.params),
                first_token_id=first_token,
                kv=kv,
                choices=[decode_pb2.ChoiceStart(index=i, first_token_id=t) for i, t in choices],
            ),
            timeout=req.timeout(),
            metadata=telemetry.outgoing(trace),
        )
        # Each choice's tokens; the prompt's KV is shared.
        kv_tokens = len(req.prompt_ids) + req.params.max_tokens * req.params.num_choices
        return cls(call, worker, worker.send(prompt_tokens, kv_tokens))

    async def outputs(self, registry: Registry) -> AsyncIterator[Output]:
        """The call's replies. From its first the worker has answered (its prompt is in place);
        lost mid-stream (UNAVAILABLE once it has streamed: it died, or it drains), it is dropped
        from routing."""
        streamed = False
        try:
            async for r in self.call:
                if not streamed:
                    streamed = True
                    self.worker.answered(self.ticket)
                yield output(
                    list(r.token_ids),
                    finish_from_pb(r.finish_reason),
                    logprobs_list_from_pb(r.logprobs),
                    logprobs_list_from_pb(r.prompt_logprobs) if r.prompt_logprobs else None,
                    r.index,
                )
        except grpc.aio.AioRpcError as e:
            if streamed and e.code() == grpc.StatusCode.UNAVAILABLE:
                registry.lost(self.worker)
            raise

    def cancel(self) -> None:
        """End the call (if it is still open) and its place in the instance's sent work."""
        self.call.cancel()
        self.worker.settle(self.ticket)
