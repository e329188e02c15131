"""One request's path through the mesh: prefill, then decode; or a colocated instance.

The first token is streamed as soon as prefill returns it. Text is detokenized here, with stop
strings held back and cut. Cancellation and deadlines reach every stage: a cancelled client
cancels the downstream call, whose worker frees what it holds; KV held for a decode call that
never took it, or whose call failed, is released here. Each request is one trace: its root
span is opened here and its context travels with every downstream call.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from prometheus_client import CollectorRegistry

from services.common import mesh_tls, telemetry
from services.common.convert import finish_from_pb, sampling_to_pb
from services.common.errors import DeadlineExceeded, DistServeError, RemoteError
from services.common.gen.distserve.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    kvtransfer_pb2,
    kvtransfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.common.sampling import FinishReason
from services.common.server import CHANNEL_OPTIONS
from services.common.slo import Slo
from services.common.text_stream import TextStream
from services.common.tokenizer import Tokenizer
from services.gateway.admission import Admission
from services.gateway.conditional import LocalPrefill
from services.gateway.observe import GatewayMetrics, RequestObserver
from services.gateway.planner_feed import PlannerFeed
from services.gateway.registry import Registry, Worker
from services.gateway.request import Request

log = logging.getLogger("distserve.gateway")

# A request whose KV cannot be pulled is prefilled again; this many handoffs in all.
KV_HANDOFF_ATTEMPTS = 3
# A prefill instance that cannot be reached is replaced by another; this many tries in all.
PREFILL_ATTEMPTS = 3
# A request whose decode (or colocated) instance is lost mid-stream moves this often at most.
MIGRATION_ATTEMPTS = 2


@dataclass(frozen=True)
class DecodeCall:
    """A Decode call and the instance serving it (`ticket`: the call in its sent work)."""

    call: grpc.aio.UnaryStreamCall
    worker: Worker
    ticket: int

    def cancel(self) -> None:
        """End the call (if it is still open) and its place in the instance's sent work."""
        self.call.cancel()
        self.worker.settle(self.ticket)


@dataclass
class Piece:
    """A part of the answer: new token ids and the text they completed; the last one has a
    finish reason."""

    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None = None


class Router:
    """Routes requests to workers and streams their tokens back."""

    def __init__(
        self,
        registry: Registry,
        tokenizer: Tokenizer,
        model: str = "",
        metrics: GatewayMetrics | None = None,
        feed: PlannerFeed | None = None,
        early_handoff_min_tokens: int | None = 0,
        local_prefill: LocalPrefill | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.registry = registry
        self.tokenizer = tokenizer
        self.model = model  # the served model's name, in spans and metrics
        self.metrics = metrics or GatewayMetrics(CollectorRegistry(), Slo())
        self.feed = feed  # finished requests' samples for the planner
        # Layer-wise handoff (decode pulls the KV while prefill computes it) for prompts of at
        # least this many tokens; None: never.
        self.early_handoff_min_tokens = early_handoff_min_tokens
        # Conditional disaggregation: short prompts prefilled on a decode instance.
        self.local_prefill = local_prefill
        # Refuses early (429) what cannot be served in time; None admits everything.
        self.admission = admission
        self._channels: dict[str, grpc.aio.Channel] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = mesh_tls.aio_channel(address, CHANNEL_OPTIONS)
            self._channels[address] = ch
        return ch

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()

    async def generate(
        self,
        req: Request,
        parent: telemetry.Context | None = None,
        operation: str = "text_completion",
        received: float | None = None,
    ) -> AsyncIterator[Piece]:
        """The request's answer, piece by piece. `parent` is the caller's trace context (from
        Envoy or the client); `operation` its GenAI operation name (`text_completion`, `chat`);
        `received` when the API got it (monotonic s)."""
        text = TextStream(self.tokenizer, req.prompt_ids, req.params.stop)
        seen = RequestObserver(self.metrics, req, self.model, operation, parent, received)
        reason: FinishReason | None = None
        error: BaseException | None = None
        verdict = None
        try:
            admitted = (
                self.admission.admit(len(req.prompt_ids), req.params.max_tokens)
                if self.admission is not None
                else contextlib.nullcontext()
            )
            events = self._migrating(req, seen)
            async with admitted as verdict, contextlib.aclosing(events):
                seen.admitted(verdict)
                async for ids, reason in events:
                    delta = text.add(ids) if ids else ""
                    if reason is not None or text.stopped:
                        reason = reason or FinishReason.STOP
                        seen.tokens_out(len(ids))
                        yield Piece(ids, delta + text.finish(), reason)
                        return
                    if ids:
                        seen.tokens_out(len(ids))
                        yield Piece(ids, delta)
        except grpc.aio.AioRpcError as e:
            error = _remote(e)
            raise error from e
        except DistServeError as e:
            error = e
            raise
        finally:
            seen.finish(reason.value if reason is not None else None, error)
            if self.admission is not None and verdict is not None:
                disaggregated = seen.mode == "disaggregated"
                self.admission.observe(
                    verdict,
                    seen.ttft_s,
                    seen.bubble_steps() if disaggregated else None,
                    seen.tpot_s,
                )
            if self.feed is not None and reason is not None and seen.ttft_s is not None:
                self.feed.add(
                    seen.arrival_unix_s, seen.prompt_tokens, seen.tokens, seen.ttft_s, seen.tpot_s
                )

    async def _migrating(
        self, req: Request, seen: RequestObserver
    ) -> AsyncIterator[tuple[list[int], FinishReason | None]]:
        """The request's tokens over one serving path; when the instance streaming them is lost
        (it died, or drained past its deadline: UNAVAILABLE), the rest of the request moves to
        another path: the prompt plus the tokens already sent is prefilled again and decoding
        continues from there, so the client's stream has no duplicate and no missing token
        (greedy output equals the failure-free output). MIGRATION_ATTEMPTS moves at most."""
        sent: list[int] = []
        part = req
        for attempt in range(MIGRATION_ATTEMPTS + 1):
            try:
                async with contextlib.aclosing(self._path(part, seen, not attempt)) as events:
                    async for ids, reason in events:
                        sent += ids
                        yield ids, reason
                return
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or attempt == MIGRATION_ATTEMPTS:
                    raise
                if len(sent) >= req.params.max_tokens:
                    raise  # nothing left to generate; the stream just lacks its end
                self.metrics.migrations.labels("decode_unavailable").inc()
                log.warning(
                    "request %s: lost its serving instance after %d tokens (%s); moving it",
                    req.request_id,
                    len(sent),
                    e.details(),
                )
                part = req.continued(sent)

    def _path(
        self, req: Request, seen: RequestObserver, first: bool
    ) -> AsyncIterator[tuple[list[int], FinishReason | None]]:
        """The serving path for (the rest of) a request: disaggregated, a short prompt
        prefilled on a decode instance, or colocated."""
        mode = self.registry.mode()
        if mode == "disaggregated" and self._prefill_locally(req):
            mode = "local-prefill"
        if first:
            seen.set_mode(mode)
        self.metrics.routes.labels(mode).inc()
        if mode == "disaggregated":
            return self._disaggregated(req, seen.context)
        if mode == "local-prefill":
            return self._colocated(req, seen.context, role="decode")
        return self._colocated(req, seen.context)

    async def _disaggregated(
        self, req: Request, trace: telemetry.Context | None
    ) -> AsyncIterator[tuple[list[int], FinishReason | None]]:
        tried: set[str] = set()
        # With the layer-wise handoff, a decode call is already pulling (`early`) by now.
        reply, early = await self._first_prefill(req, tried, trace)
        reason = finish_from_pb(reply.finish_reason)
        try:
            yield [reply.first_token_id], reason
        except BaseException:
            if early is not None:
                early.cancel()  # the decode instance releases the KV it was pulling
            await self._release(reply.kv, trace)  # the client left before a decode took the KV
            raise
        if reason is not None:
            if early is not None:
                early.cancel()  # nothing to decode (the prefill instance freed the KV)
            return
        first = reply.first_token_id
        failures: list[str] = []
        failed_decode: set[str] = set()  # the next attempt prefers another decode instance
        for attempt in range(KV_HANDOFF_ATTEMPTS):
            if attempt:
                # The KV could not be pulled (its source died, or a chunk ran out of retries):
                # prefill the prompt again, elsewhere if possible. The client already has the
                # first token; decode continues from it.
                self.metrics.migrations.labels("kv_handoff").inc()
                req = req.attempt()
                try:
                    reply, early = await self._prefill(req, tried, trace, early=False)
                except (grpc.aio.AioRpcError, DistServeError) as e:
                    failures.append(_details(e))
                    continue
                if not reply.HasField("kv"):
                    failures.append("prefill returned no KV")
                    continue
            pulled = False
            try:
                if early is None:
                    early = self._start_decode(req, first, reply.kv, trace, failed_decode)
            except BaseException:  # e.g. the deadline passed: the held KV is ours to release
                await self._release(reply.kv, trace)
                raise
            call, early = early, None
            try:
                async for ids, reason in self._decode(call, reply.kv, trace):
                    pulled = True
                    yield ids, reason
                return
            except grpc.aio.AioRpcError as e:
                if pulled or e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                # Its source or the decode instance itself failed (it may be dead and still
                # leased): the next attempt goes elsewhere when it can.
                failed_decode.add(call.worker.worker_id)
                failures.append(_details(e))
                log.warning("request %s: KV handoff failed (%s)", req.request_id, failures[-1])
        raise RemoteError(
            "UNAVAILABLE",
            f"could not hand request {req.request_id} from prefill to decode in "
            f"{KV_HANDOFF_ATTEMPTS} attempts: {'; '.join(failures)}",
        )

    async def _first_prefill(self, req: Request, tried: set[str], trace):
        """Prefill, moving to another instance when one is unreachable (nothing was streamed
        yet, so this is invisible to the client)."""
        for attempt in range(PREFILL_ATTEMPTS):
            try:
                return await self._prefill(req.attempt() if attempt else req, tried, trace)
            except RemoteError as e:
                if e.status != "UNAVAILABLE" or attempt == PREFILL_ATTEMPTS - 1:
                    raise
                self.metrics.migrations.labels("prefill_unavailable").inc()
                log.warning("request %s: %s; trying another instance", req.request_id, e)
        raise AssertionError("unreachable")

    async def _prefill(self, req: Request, tried: set[str], trace, early: bool | None = None):
        """Prefill on the least-loaded instance not tried yet (any instance if all were).

        Returns the result and, with the layer-wise handoff (`early`, default: the router's
        setting), the decode call started on the KV handle the prefill instance sent as soon as
        the prompt was scheduled: it pulls the layers while they are computed."""
        prefill = self.registry.pick_prefill(exclude=tried)
        tried.add(prefill.worker_id)
        telemetry.annotate(trace, {"distserve.prefill.instance": prefill.worker_id})
        stub = prefill_pb2_grpc.PrefillStub(self.channel(prefill.address))
        if early is None:
            # A request of one token ends at prefill's: nothing to pull, no decode to start. A
            # short prompt's KV is pulled in a few ms after prefill: there is little to hide, and
            # a pull running beside prefill would only slow its first token.
            least = self.early_handoff_min_tokens
            early = least is not None and len(req.prompt_ids) >= least and req.params.max_tokens > 1
        decode = kv = events = None
        ticket = prefill.send(len(req.prompt_ids))  # queued there until its result comes
        try:
            events = stub.Prefill(
                prefill_pb2.PrefillRequest(
                    request_id=req.worker_request_id,
                    prompt_token_ids=req.prompt_ids,
                    sampling=sampling_to_pb(req.params),
                    early_handle=early,
                ),
                timeout=_timeout(req),
                metadata=telemetry.outgoing(trace),
            )
            async for event in events:
                if event.HasField("kv"):
                    kv = event.kv
                    decode = self._start_decode(req, None, kv, trace)
                else:
                    if self.admission is not None:
                        self.admission.observe_prefill(
                            event.done.compute_ms, event.done.batch_tokens
                        )
                    return event.done, decode
            raise RemoteError("UNAVAILABLE", f"prefill instance {prefill.worker_id} sent no result")
        except BaseException as e:
            if events is not None:
                events.cancel()  # the prefill instance frees what the request holds there
            if decode is not None:
                decode.cancel()
            if kv is not None:
                # The decode call may have ended before its instance saw it (a deadline that
                # passed just then), and the prompt may be done: nobody else would release it.
                await self._release(kv, trace)
            elif events is not None and not _unreachable(e):
                # The call may have completed there just before it was cancelled here, with
                # its handle unread: ask the instance to free what it holds for the request.
                await self._abandon(stub, req)
            if not isinstance(e, grpc.aio.AioRpcError) or e.code() != grpc.StatusCode.UNAVAILABLE:
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
        self, req: Request, first_token: int | None, kv, trace, failed: set[str] = frozenset()
    ) -> DecodeCall:
        """A Decode call on the least-loaded decode instance for KV held on a prefill
        instance (`first_token` None: a streaming handle; the decode instance asks the source
        for it), another than those in `failed` if there is one."""
        decode = self.registry.pick_decode(exclude=failed)
        telemetry.annotate(trace, {"distserve.decode.instance": decode.worker_id})
        call = decode_pb2_grpc.DecodeStub(self.channel(decode.address)).Decode(
            decode_pb2.DecodeRequest(
                request_id=req.worker_request_id,
                prompt_token_ids=req.prompt_ids,
                sampling=sampling_to_pb(req.params),
                first_token_id=first_token,
                kv=kv,
            ),
            timeout=_timeout(req),
            metadata=telemetry.outgoing(trace),
        )
        return DecodeCall(call, decode, decode.send())

    async def _decode(
        self, decode: DecodeCall, kv, trace
    ) -> AsyncIterator[tuple[list[int], FinishReason | None]]:
        """Stream a decode call's tokens. The decode instance releases the KV once it has pulled
        it (its first message says it has it); the KV is released here unless that happened
        and the call did not fail: an instance lost just after its pull may have died before
        its release reached the source (a second release is answered NOT_FOUND)."""
        handed_over = failed = False
        try:
            async for r in decode.call:
                if not handed_over:
                    handed_over = True
                    decode.worker.answered(decode.ticket)
                yield list(r.token_ids), finish_from_pb(r.finish_reason)
        except grpc.aio.AioRpcError as e:
            failed = True
            if handed_over and e.code() == grpc.StatusCode.UNAVAILABLE:
                self._lost(decode.worker.worker_id, decode.worker.address)
            raise
        finally:
            decode.cancel()
            if failed or not handed_over:
                await self._release(kv, trace)

    def _lost(self, worker_id: str, address: str) -> None:
        """An instance failed mid-stream (it died, or it drains): route nothing more to it; a
        live one is back at its next heartbeat. Only that incarnation: a worker restarted under
        the same id (at another address) stays."""
        self.registry.deregister(worker_id, address)

    def _prefill_locally(self, req: Request) -> bool:
        """Conditional disaggregation: a short prompt, and a decode instance with headroom
        (nothing queued to prefill there yet, free KV for the prompt)."""
        rule = self.local_prefill
        if rule is None or not rule.allows(len(req.prompt_ids)):
            return False
        worker = self.registry.pick_decode()
        load = worker.load
        return (
            worker.queued_tokens == 0
            and load.waiting_seqs == 0
            and (load.free_kv_blocks * 16 > len(req.prompt_ids) + req.params.max_tokens)
        )

    async def _colocated(
        self, req: Request, trace, role: str = "colocated"
    ) -> AsyncIterator[tuple[list[int], FinishReason | None]]:
        """Prefill and decode on one instance: a colocated one, or (conditional
        disaggregation) a decode instance that prefills a short prompt itself."""
        worker = self.registry.pick_decode(role)
        telemetry.annotate(trace, {"distserve.decode.instance": worker.worker_id})
        call = decode_pb2_grpc.DecodeStub(self.channel(worker.address)).Decode(
            decode_pb2.DecodeRequest(
                request_id=req.worker_request_id,
                prompt_token_ids=req.prompt_ids,
                sampling=sampling_to_pb(req.params),
            ),
            timeout=_timeout(req),
            metadata=telemetry.outgoing(trace),
        )
        streamed = False
        ticket = worker.send(len(req.prompt_ids))
        try:
            async for r in call:
                if not streamed:
                    streamed = True
                    worker.answered(ticket)
                yield list(r.token_ids), finish_from_pb(r.finish_reason)
        except grpc.aio.AioRpcError as e:
            if streamed and e.code() == grpc.StatusCode.UNAVAILABLE:
                self._lost(worker.worker_id, worker.address)
            raise
        finally:
            call.cancel()
            worker.settle(ticket)

    async def _abandon(self, stub, req: Request) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await stub.Abandon(
                prefill_pb2.AbandonRequest(request_id=req.worker_request_id), timeout=5
            )

    async def _release(self, kv, trace) -> None:
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


def _timeout(req: Request) -> float | None:
    remaining = req.remaining()
    if remaining is not None and remaining <= 0:
        raise DeadlineExceeded(f"request {req.request_id} ran out of time")
    return remaining


def _unreachable(e: BaseException) -> bool:
    return isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNAVAILABLE


def _details(e: Exception) -> str:
    return e.details() if isinstance(e, grpc.aio.AioRpcError) else str(e)


def _remote(e: grpc.aio.AioRpcError) -> RemoteError:
    return RemoteError(e.code().name, e.details() or e.code().name)
