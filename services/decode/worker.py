"""A decode instance: pull KV when there is room, then decode with continuous batching.

Requests with a KV handle wait in the engine's pull queue until their prompt's KV fits (prefill
memory is the buffer between the pools); their KV is then pulled over UCX straight into the
blocks allocated for them, the handle is released, and they join the batch at the next step.
Requests without a handle are prefilled here (colocated).

One file of ~350 lines: a request's path (generate, its pull, every rank's share of it) reads
top to bottom here; what stands apart from it (the handle's checks, its release at the source,
the handoff span's figures) is in pull.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

from prometheus_client import CollectorRegistry, Histogram

from services.common import clock, telemetry
from services.common.errors import DistServeError, Unavailable
from services.common.kv_handle import KvHandle
from services.common.logprobs import TokenLogprobs
from services.common.metrics import EngineSteps, PrefillPhases, phase_histogram
from services.common.sampling import FinishReason, SamplingParams
from services.decode.config import DecodeConfig
from services.decode.pull import SourceReleases, can_reuse, check_handle, handoff_attributes
from services.engine.commands import Abort, AddPrefilled, AddRequest, PullKv, StartDecoding
from services.engine.sequence import Sequence
from services.kvtransfer.puller import KvPuller, ModelledLink, PullReport
from services.worker.announcer import DRAIN_SETTLE_S, settle
from services.worker.engine_loop import EngineFailed, EngineLoop, StepInfo
from services.worker.tp_group import start_engine

log = logging.getLogger("distserve.decode")


@dataclass(frozen=True)
class DecodeEvent:
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    queue_ms: float = 0.0  # pulled requests, first event: waiting for KV room
    pull_ms: float = 0.0  # pulled requests, first event: the pull itself
    pull_bytes: int = 0
    # With the request's sampling.logprobs: one per token; prompt_logprobs: a prompt prefilled
    # here, on its first event.
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    index: int = 0  # the choice (n > 1, best_of) the tokens belong to


@dataclass(frozen=True)
class Pulled:
    """A request's KV is here: its first event (the wait for room and the pull), the context
    of the handoff span (the handle's release joins it) and, for a layer-wise handle, the
    first token, which prefill sampled only after the request was queued here."""

    event: DecodeEvent
    handoff: telemetry.Context | None
    first_token: int | None


class DecodeWorker:
    """Serves Decode calls on one engine."""

    def __init__(self, config: DecodeConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        registry = registry or CollectorRegistry()
        self.queue_seconds = phase_histogram(
            registry, "distserve_decode_queue_seconds", "Time waiting for room for the KV."
        )
        self.transfer_seconds = phase_histogram(
            registry, "distserve_kv_transfer_seconds", "Time of a KV pull."
        )
        self.hidden_fraction = Histogram(
            "distserve_kv_overlap_fraction",
            "Part of a KV pull that ran while prefill was still computing (layer-wise handoff).",
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
            registry=registry,
        )
        self.prefill = PrefillPhases(registry)  # colocated (and local-prefill) requests
        self.engine, self.group = start_engine(
            config.model,
            config.engine,
            config.tensor_parallel_size,
            detokenize=False,
            threads=config.threads,
            kv="pull",
            kv_options={
                "policy": asdict(config.pull),
                "transport": config.kv_transport,
                "host": config.host,
            },
        )
        self.loop = EngineLoop(
            self.engine,
            on_admitted=self._admitted,
            on_step=EngineSteps(registry).observe,
            group=self.group,
        )
        kv = self.engine.kv_geometry
        self.heads = kv.heads_of(0, config.tensor_parallel_size)  # rank 0's
        link = None
        if self.engine.emulated:  # the payload moves for real, in the modelled KV's time
            spec, emulation = self.engine.runner.spec, config.engine.emulation
            link = ModelledLink(spec.kv_bytes_per_token, emulation.link_gbs * 1e9)
        self.puller = KvPuller(config.pull, config.kv_transport, link)
        self.releases = SourceReleases(self.puller)
        self._admissions: dict[str, asyncio.Future] = {}
        self.pulling = 0
        self.requests_total = 0
        self.requests_aborted = 0
        self.pulls_total = 0
        self.pull_bytes_total = 0
        self.chunks_unverified = 0  # chunks used without a checksum check (device memory)
        self.prompt_tokens_reused = 0  # prompt KV not pulled: it was in the prefix cache here
        self.pull_bytes_by_rank = [0] * config.tensor_parallel_size
        self.pulls_failed = 0
        self.draining = False

    async def start(self) -> None:
        self.loop.start()
        await self.puller.warm_up(self.config.host)

    async def stop(self) -> None:
        await self.puller.close()
        self.loop.stop()
        if self.group is not None:
            self.group.close()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; let those in flight finish for up to `timeout_s`, then end the
        rest with UNAVAILABLE: the gateway moves each to another instance, continuing from the
        tokens its client already has. Their KV is freed here and at its source."""
        self.draining = True
        if not await settle(lambda: self.loop.subscribed == 0, timeout_s):
            error = Unavailable(
                f"{self.config.worker_id} is shutting down and its drain timed out: the "
                "request moves to another instance"
            )
            log.warning("drain timed out: handing off %d requests", self.loop.subscribed)
            self.loop.fail_subscribed(error)
            for admission in self._admissions.values():  # still waiting for KV room
                if not admission.done():
                    admission.set_exception(error)
            await settle(lambda: self.loop.subscribed == 0, DRAIN_SETTLE_S)
        # Releases of pulled KV still on their way to its sources.
        await settle(lambda: not self.releases.pending, DRAIN_SETTLE_S)

    def _admitted(self, seqs: list[Sequence]) -> None:
        """Pulled requests got their blocks: (the blocks, how many of the first ones hold a
        cached prefix of the prompt already) to each one's pull."""
        for seq in seqs:
            future = self._admissions.pop(seq.request_id, None)
            if future is not None and not future.done():
                reused = seq.num_cached_tokens // self.engine.block_size
                future.set_result((list(seq.block_table.blocks), reused))

    async def generate(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        first_token: int | None,
        handle: KvHandle | None,
        trace: telemetry.Context | None = None,
        choices: tuple[tuple[int, int], ...] = (),
    ) -> AsyncIterator[DecodeEvent]:
        """A request's tokens. `trace` is the caller's trace context: the wait for KV room,
        the pull, the prefill (colocated) and the decode are recorded under it as spans.

        A request of several choices: prefilled here, it forks into all of them; pulled, into
        `choices` ((index, first token) of each that did not end at prefill; `first_token` is
        None). Each event is one choice's (`index`); the stream ends when every choice has."""
        if self.draining:
            raise Unavailable(
                f"{self.config.worker_id} is shutting down: send the request to another instance"
            )
        self.requests_total += 1
        queue = self.loop.subscribe(request_id)
        finished = failed = False
        left = params.num_choices if handle is None else max(1, len(choices))
        decoded, decode_start = 0, None  # decode_start: when decoding began
        # The handle is released at its source once its KV is here, or on any exit before.
        with self.releases.hold(handle) as release:
            try:
                if handle is None:
                    submitted = clock.monotonic()
                    self.loop.submit(request_id, AddRequest(prompt, params, request_id))
                    events, info, cached = await self._next_tokens(queue)
                    self.prefill.record(trace, submitted, info, cached)
                    decode_start = clock.monotonic()
                    for event in events:
                        left -= event.finish_reason is not None
                        finished = left == 0
                        yield event
                else:
                    pulled = await self._pull(
                        request_id, prompt, params, first_token, handle, trace, choices
                    )
                    self.loop.submit(request_id, StartDecoding(request_id, pulled.first_token))
                    release.pulled(pulled.handoff)  # decoding does not wait for the release
                    decode_start = clock.monotonic()
                    yield pulled.event
                while not finished:
                    events, _, _ = await self._next_tokens(queue)
                    for event in events:
                        decoded += len(event.token_ids)
                        left -= event.finish_reason is not None
                        finished = left == 0
                        yield event
            except DistServeError:
                failed = True  # a failure (counted where it happened), not an abort
                raise
            finally:
                if decode_start is not None:
                    # Here, not after the loop: the caller cancels the call once the last
                    # token is in, and that may close this generator at its last `yield`.
                    self._decoded(trace, decode_start, decoded, finished)
                self.loop.unsubscribe(request_id)
                self._admissions.pop(request_id, None)
                if not finished:
                    self.requests_aborted += not failed
                    await asyncio.shield(self.loop.call(Abort(request_id)))

    def _decoded(
        self, trace: telemetry.Context | None, start: float, decoded: int, finished: bool
    ) -> None:
        """The span of a request's decoding: its tokens and time per token."""
        end = clock.monotonic()
        attributes = {
            "gen_ai.usage.output_tokens": decoded,
            "decode.tpot_ms": (end - start) * 1000 / decoded if decoded else 0.0,
        }
        if not finished:  # the caller left (its client gone, a failure upstream)
            attributes["decode.cancelled"] = True
        telemetry.record("decode", trace, start, end, attributes)

    async def _next_tokens(self, queue: asyncio.Queue) -> tuple[list[DecodeEvent], StepInfo, int]:
        """The tokens (and their logprobs, if asked) produced since the last call, an event per
        choice: one or more steps' worth when the caller is slower than the engine, so a busy
        stream sends fewer, larger messages. The step info is the first step's; the last, the
        prompt tokens a prefill among them reused from the prefix cache."""
        events: dict[int, DecodeEvent] = {}
        first: StepInfo | None = None
        cached = 0
        while True:
            out, info = await queue.get()
            if isinstance(out, EngineFailed):
                raise Unavailable(f"decode failed on {self.config.worker_id}: {out}")
            if isinstance(out, Exception):
                raise out
            first = first or info
            cached = max(cached, out.num_cached_tokens)
            was = events.get(out.index) or DecodeEvent([], index=out.index)
            logprobs = was.logprobs
            if out.logprobs is not None:
                logprobs = (logprobs or []) + out.logprobs
            events[out.index] = DecodeEvent(
                was.token_ids + out.new_token_ids,
                out.finish_reason,
                logprobs=logprobs,
                prompt_logprobs=was.prompt_logprobs or out.prompt_logprobs,
                index=out.index,
            )
            if queue.empty():
                return list(events.values()), first, cached

    async def _pull(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        first_token: int | None,
        handle: KvHandle,
        trace: telemetry.Context | None,
        choices: tuple[tuple[int, int], ...] = (),
    ) -> Pulled:
        """Wait for room, then pull the handle's KV into it.

        A layer-wise handle is pulled while its prompt is computed: each chunk waits at the
        source for its layer; the first token is asked of the source once the KV is here
        (first_token is None then)."""
        check_handle(self.engine, handle)
        admission = asyncio.get_running_loop().create_future()
        self._admissions[request_id] = admission
        queued = clock.monotonic()
        self.pulling += 1
        try:
            reuse = can_reuse(self.engine, handle)
            added = AddPrefilled(prompt, first_token, params, request_id, reuse, choices)
            await self.loop.call(added)
            async with self.puller.holding(handle, trace):  # its KV stays while it waits
                blocks, reused = await admission
            started = clock.monotonic()
            self.queue_seconds.observe(started - queued)
            telemetry.record("decode.queue", trace, queued, started)
            attributes = {"kv.source": handle.source_instance, "kv.blocks_reused": reused}
            with telemetry.span("kv.handoff", trace, attributes) as span:
                handoff = telemetry.context_of(span)
                try:
                    report = await self._pull_heads(request_id, handle, blocks, reused, handoff)
                    done = clock.monotonic()
                    prefill_done = started  # the prompt was computed before the pull began
                    late_first = None
                    if handle.layerwise:
                        late_first, done_unix_s = await self.puller.first_token(handle, handoff)
                        prefill_done = clock.monotonic() - (clock.time_s() - done_unix_s)
                except DistServeError:
                    self.pulls_failed += 1
                    raise
                # The part of the pull that ran while prefill was still computing: hidden.
                hidden = max(0.0, min(done, prefill_done) - started)
                self._pulled(span, report, done - started, hidden)
        finally:
            self.pulling -= 1
        self.prompt_tokens_reused += min(reused * handle.block_size, handle.num_tokens)
        event = DecodeEvent(
            [],
            queue_ms=(started - queued) * 1000,
            pull_ms=(done - started) * 1000,
            pull_bytes=report.nbytes,
        )
        return Pulled(event, handoff, late_first)

    def _pulled(self, span, report: PullReport, seconds: float, hidden: float) -> None:
        self.pulls_total += 1
        self.pull_bytes_total += report.nbytes
        self.chunks_unverified += report.unverified
        self.transfer_seconds.observe(seconds)
        self.hidden_fraction.observe(hidden / seconds if seconds > 0 else 0.0)
        span.set_attributes(handoff_attributes(report, seconds, hidden))

    async def _pull_heads(
        self, request_id: str, handle: KvHandle, blocks: list[int], reused: int, trace
    ) -> PullReport:
        """Every rank pulls the heads it owns, from the source ranks that hold them: rank 0
        here, the others on their own data planes (told by PullKv; they report back). The first
        `reused` blocks hold a cached prefix already: only the rest is pulled. Waits for all
        of them, so that no rank still writes into the blocks when this returns or raises."""
        blocks = blocks[reused:]
        followers = []
        if self.group is not None:
            followers = self.group.expect_pulls(request_id)
        try:
            if followers:
                await self.loop.call(PullKv(request_id, handle.encode(), blocks, reused))
            cache = self.engine.runner.cache
            local = self.puller.pull_into(handle, cache, blocks, self.heads, trace, reused)
            results = await asyncio.gather(local, *followers, return_exceptions=True)
        finally:
            if self.group is not None:
                self.group.forget_pulls(request_id)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        report = results[0]
        self.pull_bytes_by_rank[0] += report.nbytes
        for rank, other in enumerate(results[1:], 1):
            self.pull_bytes_by_rank[rank] += other["nbytes"]
            report.nbytes += other["nbytes"]
            report.chunks += other["chunks"]
            report.retries += other["retries"]
            report.unverified += other["unverified"]
        return report
