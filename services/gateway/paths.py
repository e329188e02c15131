"""The ways a request is served, each an implementation of `ServingPath`: disaggregated
(gateway/handoff.py, `Handoff`) or on one instance (`OneInstance`: a colocated instance, or a
decode instance that prefills a short prompt itself). gateway/routing.py chooses which."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import grpc

from services.gateway.decode_call import DecodeCall
from services.gateway.events import Output
from services.gateway.prefix_index import PromptBlocks
from services.gateway.registry import Worker
from services.gateway.request import Request
from services.gateway.retries import Retries
from services.gateway.routing import Routing


class ServingPath(Protocol):
    """A way to serve (the rest of) a request. `mode`: its name in spans and metrics."""

    mode: str

    def serve(
        self, req: Request, prompt: PromptBlocks, trace, retries: Retries
    ) -> AsyncIterator[Output]:
        """The request's tokens; a failure is raised (the router moves a request whose
        streaming instance was lost: UNAVAILABLE)."""
        ...


class OneInstance:
    """Prefill and decode on one instance, chosen by the router: a colocated one, or
    (conditional disaggregation) a decode instance that prefills a short prompt itself. Its
    KV is its own: the instance frees it when the call ends."""

    def __init__(
        self, routing: Routing, channel: Callable[[str], grpc.aio.Channel], worker: Worker
    ) -> None:
        self.routing = routing
        self.channel = channel
        self.worker = worker
        self.mode = "colocated" if worker.role == "colocated" else "local-prefill"

    async def serve(
        self, req: Request, prompt: PromptBlocks, trace, retries: Retries
    ) -> AsyncIterator[Output]:
        cached = self.routing.routed(trace, self.worker, prompt)
        call = DecodeCall.start(self.channel, self.worker, req, trace, len(req.prompt_ids) - cached)
        try:
            async with contextlib.aclosing(call.outputs(self.routing.registry)) as outputs:
                async for out in outputs:
                    yield out
        finally:
            call.cancel()
