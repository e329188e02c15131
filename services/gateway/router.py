"""A request's answer at the gateway: admitted, served over a path, moved when it is lost.

The serving path (gateway/paths.py) is chosen by gateway/routing.py: disaggregated (prefill on
a prefill instance, its KV handed to a decode instance: gateway/handoff.py), a short prompt
prefilled on a decode instance itself (conditional disaggregation), or one colocated instance.
The first token is streamed as soon as it exists. Text is detokenized here, with stop strings
held back and cut. When the instance streaming a request is lost, the rest of the request moves
to a new path (`_migrating`); every retry of a request draws on one budget
(gateway/retries.py). Cancellation and deadlines reach every stage: a cancelled client cancels
the downstream call, whose worker frees what it holds (who frees KV held between prefill and
decode: gateway/held_kv.py). Each request is one trace: its root span is opened here and its
context travels with every downstream call.

A request of several choices (n > 1, best_of) is one stream of events, each naming its choice;
every choice gets its own text stream and `Done`. With best_of > n the choices are generated
with their tokens' logprobs (asked for if the client did not), held until all are done, and the
n of highest cumulative logprob returned, best first (`_best_of`). A request of several
choices whose instance is lost after tokens were sent ends with a retryable UNAVAILABLE error
(before any token it simply starts again elsewhere): its choices do not move one by one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator

import grpc
from prometheus_client import CollectorRegistry

from services.common import mesh_tls, telemetry
from services.common.errors import DistServeError, RemoteError
from services.common.sampling import FinishReason, SamplingParams
from services.common.server import CHANNEL_OPTIONS
from services.common.slo import Slo
from services.common.text_stream import TextStream
from services.common.tokenizer import Tokenizer
from services.gateway.admission import Admission
from services.gateway.events import Done, Output
from services.gateway.handoff import Handoff
from services.gateway.metrics import GatewayMetrics
from services.gateway.observe import RequestObserver
from services.gateway.paths import OneInstance, ServingPath
from services.gateway.planner_feed import PlannerFeed
from services.gateway.prefix_index import PromptBlocks
from services.gateway.request import Request
from services.gateway.retries import Failover, RetryPolicy
from services.gateway.routing import Routing

log = logging.getLogger("distserve.gateway")


class Router:
    """Routes requests to workers and streams their tokens back."""

    def __init__(
        self,
        routing: Routing,
        tokenizer: Tokenizer,
        model: str = "",
        metrics: GatewayMetrics | None = None,
        feed: PlannerFeed | None = None,
        layerwise_min_tokens: int | None = 0,
        admission: Admission | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.routing = routing
        self.tokenizer = tokenizer
        self.model = model  # the served model's name, in spans and metrics
        self.metrics = metrics or GatewayMetrics(CollectorRegistry(), Slo())
        self.feed = feed  # requests' arrivals and finishes, for the planner
        # Refuses early (429) what cannot be served in time; None admits everything.
        self.admission = admission
        self.retry = retry or RetryPolicy()  # how often one request may be tried again, in all
        self._channels: dict[str, grpc.aio.Channel] = {}
        # Layer-wise handoff (decode pulls the KV while prefill computes it) for prompts of at
        # least `layerwise_min_tokens` tokens; None: never.
        self.handoff = Handoff(routing, self.channel, admission, layerwise_min_tokens)

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
    ) -> AsyncIterator[Output]:
        """The request's answer, event by event, each with the text it completed. `parent` is
        the caller's trace context (from Envoy or the client); `operation` its GenAI operation
        name (`text_completion`, `chat`); `received` when the API got it (monotonic s)."""
        p = req.params
        ranked = p.best_of is not None and p.best_of > p.n
        work = req
        if ranked and p.logprobs is None:  # the ranking reads each token's logprob
            work = dataclasses.replace(req, params=dataclasses.replace(p, logprobs=0))
        seen = RequestObserver(self.metrics, req, self.model, operation, parent, received)
        if self.feed is not None:
            self.feed.arrived(seen.arrival_unix_s, seen.prompt_tokens)
        reason: FinishReason | None = None
        error: BaseException | None = None
        verdict = None
        try:
            admitted = (
                self.admission.admit(len(req.prompt_ids), req.params.max_tokens)
                if self.admission is not None
                else contextlib.nullcontext()
            )
            events = self._texts(self._migrating(work, seen), req, seen)
            if ranked:
                events = _best_of(events, p)
            async with admitted as verdict, contextlib.aclosing(events):
                seen.admitted(verdict)
                async for out in events:
                    if isinstance(out, Done):
                        reason = out.reason
                    yield out
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

    async def _texts(
        self, events: AsyncIterator[Output], req: Request, seen: RequestObserver
    ) -> AsyncIterator[Output]:
        """The events with the text each choice's tokens complete (stop strings held back and
        cut); a choice ends at its `Done` or its stop string, the stream after every choice."""
        p = req.params
        texts: dict[int, TextStream] = {}
        ended: set[int] = set()
        async with contextlib.aclosing(events):
            async for out in events:
                i = out.index
                if i in ended:  # its stop string ended it here first
                    continue
                text = texts.get(i)
                if text is None:
                    text = texts[i] = TextStream(
                        self.tokenizer,
                        req.prompt_ids,
                        p.stop,
                        p.min_tokens,
                        include_stop=p.include_stop_str_in_output,
                        skip_special=p.skip_special_tokens,
                    )
                ids = out.token_ids
                delta = text.add(ids) if ids else ""
                if isinstance(out, Done) or text.stopped:
                    reason = out.reason if isinstance(out, Done) else FinishReason.STOP
                    seen.tokens_out(len(ids))
                    ended.add(i)
                    yield Done(
                        ids,
                        reason,
                        delta + text.finish(),
                        out.logprobs,
                        out.prompt_logprobs,
                        index=i,
                    )
                    if len(ended) == p.num_choices:
                        return
                elif ids:
                    seen.tokens_out(len(ids))
                    yield dataclasses.replace(out, text=delta)

    async def _migrating(self, req: Request, seen: RequestObserver) -> AsyncIterator[Output]:
        """The request's tokens over one serving path; when the instance streaming them is lost
        (it died, or drained past its deadline: UNAVAILABLE), the rest of the request moves to
        another path: the prompt plus the tokens already sent is prefilled again and decoding
        continues from there, so the client's stream has no duplicate and no missing token
        (greedy output equals the failure-free output). Every move, and every retry on the
        path, is drawn from the request's one retry budget."""
        retries = self.retry.start(self._count_retry)
        sent: list[int] = []
        part = req
        first = True
        while True:
            try:
                prompt = PromptBlocks(part.prompt_ids)
                path = self._path(part, prompt, seen, first)
                events = path.serve(part, prompt, seen.context, retries)
                async with contextlib.aclosing(events):
                    async for out in events:
                        sent += out.token_ids
                        yield out
                return
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                if req.params.num_choices > 1 and sent:
                    raise RemoteError(
                        "UNAVAILABLE",
                        f"request {req.request_id} of {req.params.num_choices} choices lost its "
                        f"serving instance after {len(sent)} tokens ({e.details()}); several "
                        "choices do not move to another instance: send the request again",
                    ) from e
                if len(sent) >= req.params.max_tokens:
                    raise  # nothing left to generate; the stream just lacks its end
                if not retries.allow(Failover.DECODE_UNAVAILABLE, e.details() or ""):
                    raise
                log.warning(
                    "request %s: lost its serving instance after %d tokens (%s); moving it",
                    req.request_id,
                    len(sent),
                    e.details(),
                )
                part = req.continued(sent) if sent else req.attempt()
                first = False

    def _count_retry(self, kind: Failover) -> None:
        self.metrics.migrations.labels(kind.value).inc()

    def _path(
        self, req: Request, prompt: PromptBlocks, seen: RequestObserver, first: bool
    ) -> ServingPath:
        """The serving path for (the rest of) a request, as routing chooses it."""
        worker = self.routing.one_instance(req, prompt)
        path = self.handoff if worker is None else OneInstance(self.routing, self.channel, worker)
        if first:
            seen.set_mode(path.mode)
        self.metrics.routes.labels(path.mode).inc()
        return path


async def _best_of(events: AsyncIterator[Output], p: SamplingParams) -> AsyncIterator[Output]:
    """best_of > n: every choice's events, held until all are done, then those of the n
    choices of highest cumulative logprob (the sum over their tokens), best first, indexed
    0..n-1; the logprobs asked for only by the ranking are dropped, the prompt's go first."""
    kept: dict[int, list[Output]] = {}
    prompt = None
    async with contextlib.aclosing(events):
        async for out in events:
            kept.setdefault(out.index, []).append(out)
            prompt = prompt or out.prompt_logprobs
    score = {i: sum(lp.logprob for o in outs for lp in o.logprobs) for i, outs in kept.items()}
    best = sorted(kept, key=lambda i: (-score[i], i))[: p.n]
    for rank, i in enumerate(best):
        for at, o in enumerate(kept[i]):
            yield dataclasses.replace(
                o,
                index=rank,
                logprobs=o.logprobs if p.logprobs is not None else (),
                prompt_logprobs=prompt if rank == at == 0 else None,
            )


def _remote(e: grpc.aio.AioRpcError) -> RemoteError:
    return RemoteError(e.code().name, e.details() or e.code().name)
