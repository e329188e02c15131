"""The prefill -> decode handoff of one request, as the gateway drives it.

A prefill instance runs the prompt and holds its KV under a lease; it answers with the first
token and a `KvHandle`. A decode instance, given the handle, pulls the KV and streams the rest
of the tokens. With the layer-wise handoff the prefill instance sends the handle as soon as the
prompt is scheduled, and the decode call starts then, pulling each layer as it is computed;
otherwise the decode call starts after prefill returned. A prefill instance that cannot be
reached is replaced by another; a handoff that fails (the source died, a chunk ran out of
retries, the decode instance was lost before it streamed) is tried again from a new prefill,
elsewhere when possible, and decode continues from the first token the client already has. All
of these retries draw on the request's one `Retries` budget (gateway/retries.py).

Who frees KV held on a prefill instance, and when (each release after the first is answered
NOT_FOUND, so a doubt is settled by releasing):
- the decode instance, with Release, once it has pulled the KV (its first reply tells the
  gateway it has it);
- the prefill instance itself, when its Prefill call ends before the handle went out (the
  caller left), when the request ended at its first token (nothing to decode), on Abandon, and
  when the lease lapses: the last resort for a gateway or decode instance that died;
- this module, with Release (`release`): when the client leaves between the first token and a
  decode call taking the KV, when a decode call fails or ends before it answered (its instance
  may have died before its own release reached the source), when a decode call cannot be
  started, and when the Prefill call fails after it sent a handle;
- this module, with Abandon: when a Prefill call is cancelled here after it may have completed
  there, its handle unread.
KV on a decode instance is its own: its engine frees it when the request ends, fails or its call
is cancelled.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from services.common import telemetry
from services.common.convert import finish_from_pb, sampling_to_pb
from services.common.errors import DeadlineExceeded, DistServeError, RemoteError
from services.common.gen.distserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    kvtransfer_pb2,
    kvtransfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.common.sampling import FinishReason
from services.gateway.admission import Admission
from services.gateway.prefix_index import PromptBlocks
from services.gateway.registry import Registry, Worker
from services.gateway.request import Request
from services.gateway.retries import Failover, Retries

log = logging.getLogger("distserve.gateway")

Tokens = tuple[list[int], FinishReason | None]


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
    ) -> DecodeCall:
        """A Decode call on `worker`: with `kv`, for KV held on a prefill instance
        (`first_token` None: a streaming handle); without, the worker prefills the prompt
        itself (`prompt_tokens` of it queue there until it answers)."""
        telemetry.annotate(trace, {"distserve.decode.instance": worker.worker_id})
        call = decode_pb2_grpc.DecodeStub(channel(worker.address)).Decode(
            decode_pb2.DecodeRequest(
                request_id=req.worker_request_id,
                prompt_token_ids=req.prompt_ids,
                sampling=sampling_to_pb(req.params),
                first_token_id=first_token,
                kv=kv,
            ),
            timeout=req.timeout(),
            metadata=telemetry.outgoing(trace),
        )
        kv_tokens = len(req.prompt_ids) + req.params.max_tokens
        return cls(call, worker, worker.send(prompt_tokens, kv_tokens))

    async def tokens(self, registry: Registry) -> AsyncIterator[Tokens]:
        """The call's tokens. From its first reply the worker has answered (its prompt is in
        place); lost mid-stream (UNAVAILABLE once it has streamed: it died, or it drains), it is
        dropped from routing."""
        streamed = False
        try:
            async for r in self.call:
                if not streamed:
                    streamed = True
                    self.worker.answered(self.ticket)
                yield list(r.token_ids), finish_from_pb(r.finish_reason)
        except grpc.aio.AioRpcError as e:
            if streamed and e.code() == grpc.StatusCode.UNAVAILABLE:
                registry.lost(self.worker)
            raise

    def cancel(self) -> None:
        """End the call (if it is still open) and its place in the instance's sent work."""
        self.call.cancel()
        self.worker.settle(self.ticket)


class Handoff:
    """Prefill on a prefill instance, then decode on a decode instance that pulls the KV.

    `layerwise_min_tokens`: prompts of at least this many tokens use the layer-wise handoff
    (None: none do)."""

    def __init__(
        self,
        registry: Registry,
        channel: Callable[[str], grpc.aio.Channel],
        admission: Admission | None = None,
        layerwise_min_tokens: int | None = 0,
    ) -> None:
        self.registry = registry
        self.channel = channel
        self.admission = admission
        self.layerwise_min_tokens = layerwise_min_tokens

    async def run(
        self,
        req: Request,
        trace: telemetry.Context | None,
        retries: Retries,
        prompt: PromptBlocks | None = None,
    ) -> AsyncIterator[Tokens]:
        """The request's tokens: the first from prefill, the rest from decode. `prompt`: its
        block hashes, to route by the prefix caches."""
        prompt = prompt or PromptBlocks(req.prompt_ids)
        tried: set[str] = set()  # prefill instances; a new prefill prefers another
        reply, pulling = await self._first_prefill(req, prompt, tried, trace, retries)
        reason = finish_from_pb(reply.finish_reason)
        try:
            yield [reply.first_token_id], reason
        except BaseException:
            if pulling is not None:
                pulling.cancel()  # the decode instance releases the KV it was pulling
            await self.release(reply.kv, trace)  # the client left before a decode took the KV
            raise
        if reason is not None:
            if pulling is not None:
                pulling.cancel()  # nothing to decode (the prefill instance freed the KV)
            return
        first = reply.first_token_id
        failed_decode: set[str] = set()  # the next try prefers another decode instance
        while True:
            try:
                if pulling is None:
                    pulling = self._start_decode(req, prompt, first, reply.kv, trace, failed_decode)
            except BaseException:  # e.g. the deadline passed: the held KV is ours to release
                await self.release(reply.kv, trace)
                raise
            call, pulling = pulling, None
            streamed = False
            try:
                async for ids, reason in self._decode(call, reply.kv, trace):
                    streamed = True
                    yield ids, reason
                return
            except grpc.aio.AioRpcError as e:
                if streamed or e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                # Its source or the decode instance itself failed (it may be dead and still
                # leased): the next try goes elsewhere when it can.
                failed_decode.add(call.worker.worker_id)
                failure = _details(e)
                log.warning("request %s: KV handoff failed (%s)", req.request_id, failure)
            # The KV could not be pulled: prefill the prompt again, elsewhere if possible. The
            # client already has the first token; decode continues from it.
            while True:
                if not retries.allow(Failover.KV_HANDOFF, failure):
                    raise RemoteError(
                        "UNAVAILABLE",
                        f"could not hand request {req.request_id} from prefill to decode in "
                        f"{retries.count(Failover.KV_HANDOFF) + 1} attempts: "
                        f"{'; '.join(retries.failures)}",
                    )
                req = req.attempt()
                try:
                    reply, pulling = await self._prefill(req, prompt, tried, trace, layerwise=False)
                except DeadlineExceeded:
                    raise
                except (grpc.aio.AioRpcError, DistServeError) as e:
                    failure = _details(e)
                    continue
                if not reply.HasField("kv"):
                    failure = "prefill returned no KV"
                    continue
                break

    async def _first_prefill(
        self, req: Request, prompt: PromptBlocks, tried: set[str], trace, retries: Retries
    ) -> tuple[prefill_pb2.PrefillResponse, DecodeCall | None]:
        """Prefill, moving to another instance when one is unreachable (nothing was streamed
        yet, so this is invisible to the client)."""
        while True:
            try:
                return await self._prefill(req, prompt, tried, trace)
            except RemoteError as e:
                if e.status != "UNAVAILABLE" or not retries.allow(
                    Failover.PREFILL_UNAVAILABLE, str(e)
                ):
                    raise
                log.warning("request %s: %s; trying another instance", req.request_id, e)
                req = req.attempt()

    async def _prefill(
        self,
        req: Request,
        prompt: PromptBlocks,
        tried: set[str],
        trace,
        layerwise: bool | None = None,
    ) -> tuple[prefill_pb2.PrefillResponse, DecodeCall | None]:
        """Prefill where the prompt's first token comes soonest (its cached prefix and the
        instance's queue: `Registry.pick_prefill`), on an instance not tried yet (any instance
        if all were).

        Returns the result and, with the layer-wise handoff (`layerwise`, default: for prompts
        of at least `layerwise_min_tokens`), the decode call started on the KV handle the
        prefill instance sent as soon as the prompt was scheduled: it pulls the layers while
        they are computed."""
        prefill = self.registry.pick_prefill(exclude=tried, prompt=prompt)
        tried.add(prefill.worker_id)
        telemetry.annotate(trace, {"distserve.prefill.instance": prefill.worker_id})
        cached = self.registry.routed(trace, prefill, prompt)
        stub = prefill_pb2_grpc.PrefillStub(self.channel(prefill.address))
        if layerwise is None:
            # A request of one token ends at prefill's: nothing to pull, no decode to start. A
            # short prompt's KV is pulled in a few ms after prefill: there is little to hide, and
            # a pull running beside prefill would only slow its first token.
            least = self.layerwise_min_tokens
            layerwise = (
                least is not None and len(req.prompt_ids) >= least and req.params.max_tokens > 1
            )
        pulling = kv = events = None
        ticket = prefill.send(len(req.prompt_ids) - cached)  # queued there until its result
        try:
            events = stub.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=req.worker_request_id,
                    prompt_token_ids=req.prompt_ids,
                    sampling=sampling_to_pb(req.params),
                    early_handle=layerwise,
                ),
                timeout=req.timeout(),
                metadata=telemetry.outgoing(trace),
            )
            async for event in events:
                if event.HasField("kv"):
                    kv = event.kv
                    pulling = self._start_decode(req, prompt, None, kv, trace)
                else:
                    if self.admission is not None:
                        self.admission.observe_prefill(
                            event.done.compute_ms, event.done.batch_tokens
                        )
                    return event.done, pulling
            raise RemoteError("UNAVAILABLE", f"prefill instance {prefill.worker_id} sent no result")
        except BaseException as e:
            if events is not None:
                events.cancel()  # the prefill instance frees what the request holds there
            if pulling is not None:
                pulling.cancel()
            if kv is not None:
                # The decode call may have ended before its instance saw it (a deadline that
                # passed just then), and the prompt may be done: nobody else would release it.
                await self.release(kv, trace)
            elif events is not None and not _unreachable(e):
                # The call may have completed there just before it was cancelled here, with
                # its handle unread: ask the instance to free what it holds for the request.
                await self._abandon(stub, req)
            if not _unreachable(e):
                raise
            # Unreachable: stop routing to it until it heartbeats (and registers) again.
            self.registry.deregister(prefill.worker_id, prefill.address)
            raise RemoteError(
                "UNAVAILABLE",
                f"prefill instance {prefill.worker_id} ({prefill.address}) is unavailable: "
                f"{e.details()}",
            ) from e
        finally:
            prefill.settle(ticket)

    def _start_decode(
        self,
        req: Request,
        prompt: PromptBlocks,
        first_token: int | None,
        kv: common_pb2.KvHandle,
        trace,
        failed: set[str] = frozenset(),
    ) -> DecodeCall:
        """A Decode call for KV held on a prefill instance (`first_token` None: a streaming
        handle; the decode instance asks the source for it) on a lightly loaded decode instance
        holding the most of the prompt (it pulls only the rest), another than those in
        `failed` if there is one."""
        decode = self.registry.pick_decode(exclude=failed, prompt=prompt)
        self.registry.routed(trace, decode, prompt)
        return DecodeCall.start(self.channel, decode, req, trace, first_token=first_token, kv=kv)

    async def _decode(
        self, decode: DecodeCall, kv: common_pb2.KvHandle, trace
    ) -> AsyncIterator[Tokens]:
        """Stream a decode call's tokens. The decode instance releases the KV once it has pulled
        it (its first message says it has it); the KV is released here unless that happened
        and the call did not fail: an instance lost just after its pull may have died before
        its release reached the source (a second release is answered NOT_FOUND)."""
        handed_over = failed = False
        try:
            async with contextlib.aclosing(decode.tokens(self.registry)) as tokens:
                async for ids, reason in tokens:
                    handed_over = True
                    yield ids, reason
        except grpc.aio.AioRpcError:
            failed = True
            raise
        finally:
            decode.cancel()
            if failed or not handed_over:
                await self.release(kv, trace)

    async def _abandon(self, stub: prefill_pb2_grpc.PrefillStub, req: Request) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.Abandon(
                prefill_pb2.AbandonRequest(request_id=req.worker_request_id), timeout=5
            )

    async def release(self, kv: common_pb2.KvHandle, trace) -> None:
        """Free KV a decode instance never took (the request ended or failed in between)."""
        if not kv.handle_id:
            return
        stub = kvtransfer_pb2_grpc.KvTransferStub(self.channel(kv.control_address))
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.Release(
                kvtransfer_pb2.KvAccess(handle_id=kv.handle_id, access_token=kv.access_token),
                timeout=5,
                metadata=telemetry.outgoing(trace),
            )


def _unreachable(e: BaseException) -> bool:
    return isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAVAILABLE


def _details(e: Exception) -> str:
    return e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)
