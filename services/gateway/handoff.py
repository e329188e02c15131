"""The disaggregated serving path: prefill on a prefill instance, then decode on a decode
instance that pulls the prompt's KV.

The prefill instance holds the KV under a lease and answers with the first token and a
`KvHandle`. With the layer-wise handoff it sends the handle as soon as the prompt is scheduled,
and the decode call starts then, pulling each layer as it is computed; otherwise the decode call
starts after prefill returned. A request is served in tries (`Handoff.serve`, one loop): a
prefill instance that cannot be reached before the first token is replaced by another
(`Failover.PREFILL_UNAVAILABLE`); a handoff that fails after it (the source died, a chunk ran out
of retries, the decode instance was lost before it streamed) is tried again from a new prefill,
elsewhere when possible, and decode continues from the first token the client already has
(`Failover.KV_HANDOFF`). Every retry draws on the request's one `Retries` budget
(gateway/retries.py). Each try's KV on the prefill instance is owned by a `HeldKv`
(gateway/held_kv.py: who frees what).

A request of several choices (n > 1, best_of) is prefilled once: prefill answers with every
choice's first token and one handle, and one decode call pulls the KV once and decodes the
choices that did not end at their first token, sharing it (no layer-wise handoff: the choices'
first tokens travel with the call).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from services.common import telemetry
from services.common.convert import finish_from_pb, logprobs_list_from_pb, sampling_to_pb
from services.common.errors import DeadlineExceeded, DistServeError, RemoteError
from services.common.gen.distserve.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc
from services.gateway.admission import Admission
from services.gateway.decode_call import DecodeCall
from services.gateway.events import Done, HandleReady, Output, Prefilled, output
from services.gateway.held_kv import HeldKv
from services.gateway.prefix_index import PromptBlocks
from services.gateway.request import Request
from services.gateway.retries import Failover, Retries
from services.gateway.routing import Routing

log = logging.getLogger("distserve.gateway")


@dataclass
class _Tries:
    """What a request's tries so far tell the next one."""

    first_token: int | None = None  # once the client has it: later tries continue from it
    # A request of several choices: (index, first token) of those still to decode.
    choices: tuple[tuple[int, int], ...] = ()
    tried_prefill: set[str] = field(default_factory=set)  # a new prefill prefers another
    failed_decode: set[str] = field(default_factory=set)  # a new decode prefers another


class _Retry(Exception):
    """A try failed in a way another try may not: why, for the request's retry budget."""


class Handoff:
    """The disaggregated serving path (see the module docstring).

    `layerwise_min_tokens`: prompts of at least this many tokens use the layer-wise handoff
    (None: none do)."""

    mode = "disaggregated"

    def __init__(
        self,
        routing: Routing,
        channel: Callable[[str], grpc.aio.Channel],
        admission: Admission | None = None,
        layerwise_min_tokens: int | None = 0,
    ) -> None:
        self.routing = routing
        self.channel = channel
        self.admission = admission
        self.layerwise_min_tokens = layerwise_min_tokens

    async def serve(
        self, req: Request, prompt: PromptBlocks, trace, retries: Retries
    ) -> AsyncIterator[Output]:
        """The request's tokens: the first from prefill, the rest from decode, over as many
        tries as its retry budget allows."""
        tries = _Tries()
        while True:
            try:
                async with contextlib.aclosing(self._try(req, prompt, tries, trace)) as outputs:
                    async for out in outputs:
                        yield out
                return
            except _Retry as e:
                failure = str(e)
                before_first = tries.first_token is None  # the client has nothing yet
                kind = Failover.PREFILL_UNAVAILABLE if before_first else Failover.KV_HANDOFF
                if not retries.allow(kind, failure):
                    if kind is Failover.PREFILL_UNAVAILABLE:
                        raise e.__cause__ from None
                    raise RemoteError(
                        "UNAVAILABLE",
                        f"could not hand request {req.request_id} from prefill to decode in "
                        f"{retries.count(kind) + 1} attempts: {'; '.join(retries.failures)}",
                    ) from None
                log.warning("request %s: %s; trying again", req.request_id, failure)
                req = req.attempt()

    async def _try(
        self, req: Request, prompt: PromptBlocks, tries: _Tries, trace
    ) -> AsyncIterator[Output]:
        """One try: prefill (its first token to the client, on the first try), then decode
        pulling its KV. Raises `_Retry` for a failure another try may mend."""
        # A request of one token ends at prefill's: nothing to pull, no decode to start. A short
        # prompt's KV is pulled in a few ms after prefill: there is little to hide, and a pull
        # running beside prefill would only slow its first token. A retry pulls after prefill.
        least = self.layerwise_min_tokens
        layerwise = (
            tries.first_token is None
            and least is not None
            and len(req.prompt_ids) >= least
            and req.params.max_tokens > 1
            and req.params.num_choices == 1
        )
        decode: DecodeCall | None = None
        async with HeldKv(self.channel, trace) as held:
            try:
                try:
                    events = self._prefill(req, prompt, tries, held, trace, layerwise)
                    async with contextlib.aclosing(events):
                        async for event in events:
                            if isinstance(event, HandleReady):
                                decode = self._start_decode(req, prompt, None, event.kv, trace)
                            else:
                                prefilled = event
                except DeadlineExceeded:
                    raise
                except (grpc.aio.AioRpcError, DistServeError) as e:
                    unreachable = isinstance(e, RemoteError) and e.status == "UNAVAILABLE"
                    if tries.first_token is None and not unreachable:
                        raise
                    raise _Retry(_details(e)) from e
                if tries.first_token is None:
                    tries.first_token = prefilled.first_token
                    firsts = prefilled.firsts()
                    for first in firsts:
                        yield first
                    tries.choices = tuple(
                        (o.index, o.token_ids[0]) for o in firsts if not isinstance(o, Done)
                    )
                    if not tries.choices:
                        return
                if decode is None:
                    if prefilled.kv is None:
                        raise _Retry("prefill returned no KV")
                    several = req.params.num_choices > 1
                    decode = self._start_decode(
                        req,
                        prompt,
                        None if several else tries.first_token,
                        held.kv,
                        trace,
                        tries.failed_decode,
                        tries.choices if several else (),
                    )
                async with contextlib.aclosing(self._decode(decode, held, tries)) as outputs:
                    async for out in outputs:
                        yield out
            finally:
                if decode is not None:
                    decode.cancel()  # a decode instance pulling the KV releases it

    async def _prefill(
        self,
        req: Request,
        prompt: PromptBlocks,
        tries: _Tries,
        held: HeldKv,
        trace,
        layerwise: bool,
    ) -> AsyncIterator[HandleReady | Prefilled]:
        """A Prefill call where the prompt's first token comes soonest (its cached prefix and
        the instance's queue: `Routing.pick_prefill`), on an instance not tried yet (any
        instance if all were): with `layerwise`, its handle as soon as the prompt is
        scheduled, then its result. An instance that cannot be reached is dropped from routing
        until it reports again: RemoteError UNAVAILABLE."""
        prefill = self.routing.pick_prefill(prompt, exclude=tries.tried_prefill)
        tries.tried_prefill.add(prefill.worker_id)
        telemetry.annotate(trace, {"distserve.prefill.instance": prefill.worker_id})
        cached = self.routing.routed(trace, prefill, prompt)
        stub = prefill_pb2_grpc.PrefillStub(self.channel(prefill.address))
        ticket = prefill.send(len(req.prompt_ids) - cached)  # queued there until its result
        call = stub.Prefill(
            prefill_pb2.PrefillRequest(
                request_id=req.worker_request_id,
                prompt_token_ids=req.prompt_ids,
                sampling=sampling_to_pb(req.params),
                layerwise=layerwise,
            ),
            timeout=req.timeout(),
            metadata=telemetry.outgoing(trace),
        )
        held.prefilling(stub, req.worker_request_id)
        done = None
        try:
            async for event in call:
                if event.HasField("done"):
                    done = event.done
                    break
                held.handle(event.kv)
                yield HandleReady(event.kv)
            if done is None:
                raise RemoteError(
                    "UNAVAILABLE", f"prefill instance {prefill.worker_id} sent no result"
                )
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            held.unreachable()
            self.routing.registry.deregister(prefill.worker_id, prefill.address)
            raise RemoteError(
                "UNAVAILABLE",
                f"prefill instance {prefill.worker_id} ({prefill.address}) is unavailable: "
                f"{e.details()}",
            ) from e
        finally:
            if done is None:
                call.cancel()  # the prefill instance frees what the request holds there
            prefill.settle(ticket)
        held.prefilled(done.kv if done.HasField("kv") else None)
        if self.admission is not None:
            self.admission.observe_prefill(done.compute_ms, done.batch_tokens)
        first_logprobs = (
            [done.first_token_logprobs] if done.HasField("first_token_logprobs") else []
        )
        others = tuple(
            output(
                [c.token_id],
                finish_from_pb(c.finish_reason),
                logprobs_list_from_pb([c.logprobs] if c.HasField("logprobs") else []),
                index=i,
            )
            for i, c in enumerate(done.other_choices, 1)
        )
        yield Prefilled(
            done.first_token_id,
            finish_from_pb(done.finish_reason),
            held.kv,
            done.compute_ms,
            done.batch_tokens,
            logprobs_list_from_pb(first_logprobs),
            logprobs_list_from_pb(done.prompt_logprobs) if done.prompt_logprobs else None,
            others,
        )

    def _start_decode(
        self,
        req: Request,
        prompt: PromptBlocks,
        first_token: int | None,
        kv: common_pb2.KvHandle,
        trace,
        failed: set[str] = frozenset(),
        choices: tuple[tuple[int, int], ...] = (),
    ) -> DecodeCall:
        """A Decode call for KV held on a prefill instance (`first_token` None: a layer-wise
        handle; the decode instance asks the source for it) on a lightly loaded decode instance
        holding the most of the prompt (it pulls only the rest), another than those in
        `failed` if there is one."""
        decode = self.routing.pick_decode(prompt, exclude=failed)
        self.routing.routed(trace, decode, prompt)
        return DecodeCall.start(
            self.channel, decode, req, trace, first_token=first_token, kv=kv, choices=choices
        )

    async def _decode(self, call: DecodeCall, held: HeldKv, tries: _Tries) -> AsyncIterator[Output]:
        """The decode call's tokens. Its first reply says its instance has the KV; a call that
        fails after that may have died before its release reached the source (`HeldKv`). One
        that fails UNAVAILABLE before it answered (its source or the instance itself failed:
        it may be dead and still leased) is a `_Retry`, which goes elsewhere when it can."""
        streamed = False
        try:
            async with contextlib.aclosing(call.outputs(self.routing.registry)) as outputs:
                async for out in outputs:
                    streamed = True
                    held.taken()
                    yield out
        except grpc.aio.AioRpcError as e:
            held.doubted()
            if streamed or e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            tries.failed_decode.add(call.worker.worker_id)
            raise _Retry(f"KV handoff failed: {_details(e)}") from e


def _details(e: Exception) -> str:
    return e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
