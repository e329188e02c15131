"""A prefill instance: the engine in prefill-and-hold mode, leases on held KV, and the KV
transfer server (control service and UCX chunk server) that decode instances pull from."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry

from services.common import clock, telemetry
from services.common.errors import InvalidRequest, Unavailable, UnsupportedModel
from services.common.kv_handle import KvHandle, RankSource
from services.common.logprobs import TokenLogprobs
from services.common.metrics import EngineSteps, PrefillPhases, phase_histogram
from services.common.sampling import FinishReason, SamplingParams
from services.engine.commands import Abort, AddRequest, Release
from services.kvtransfer.chunk_server import ChunkServer
from services.kvtransfer.faults import FaultInjector
from services.kvtransfer.leases import Lease, LeaseTable
from services.kvtransfer.memory import dtype_name
from services.kvtransfer.source import ChunkSource
from services.kvtransfer.ucx_setup import ucx_available
from services.prefill.config import PrefillConfig
from services.prefill.held_prompt import HeldPrompt, PromptState
from services.worker.announcer import DRAIN_SETTLE_S, settle
from services.worker.engine_loop import EngineFailed, EngineLoop
from services.worker.tp_group import start_engine

log = logging.getLogger("distserve.prefill")


@dataclass(frozen=True)
class ChoiceFirst:
    """The first token of one more choice of a request (n > 1, best_of)."""

    token: int
    finish_reason: FinishReason | None
    logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    finish_reason: FinishReason | None
    handle: KvHandle | None  # None when the request ended at its first token or KV is discarded
    queue_ms: float
    compute_ms: float
    batch_size: int
    batch_tokens: int
    # Asked for by the request's sampling: the first token's, and the prompt's (positions 1..).
    first_token_logprobs: TokenLogprobs | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    # A request of several choices: choices 1.. (the fields above are choice 0's). The KV is
    # held (`handle`) while any choice goes on.
    other_choices: tuple[ChoiceFirst, ...] = ()


class PrefillWorker:
    """Runs prompts, samples their first token, holds their KV under a lease until released."""

    def __init__(self, config: PrefillConfig, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        registry = registry or CollectorRegistry()
        self.phases = PrefillPhases(registry)
        self.lease_seconds = phase_histogram(
            registry, "distserve_kv_lease_seconds", "How long prompts' KV was held."
        )
        self.engine, self.group = start_engine(
            config.model,
            config.engine,
            config.tensor_parallel_size,
            detokenize=False,
            threads=config.threads,
            kv="serve",
            kv_options={"host": config.host, "ucx_port": config.ucx_port},
        )
        self.loop = EngineLoop(
            self.engine,
            hold=True,
            on_scheduled=self._scheduled,
            on_layer=self._layer_done,
            on_step=EngineSteps(registry).observe,
            group=self.group,
        )
        # Every prompt here from its submission until its KV is freed (held_prompt.py).
        self._prompts: dict[str, HeldPrompt] = {}
        self.leases = LeaseTable(config.lease_s, config.max_lease_s)
        kv = self.engine.kv_geometry
        tp = config.tensor_parallel_size
        # This rank's heads; a tensor-parallel instance's other ranks serve theirs themselves.
        self.source = ChunkSource(
            self.leases,
            self.engine.runner.cache.region,
            kv.num_layers,
            kv.heads_of(0, tp),
            FaultInjector(config.kv_faults) if config.kv_faults else None,
            planes=kv.planes,
        )
        # The UCX data plane when ucxx is here and wanted; the gRPC fallback is always served.
        self.chunks = ChunkServer(self.source) if config.ucx and ucx_available() else None
        if config.ucx and self.chunks is None:
            log.warning("ucxx is not importable: KV is served over the gRPC fallback only")
        if self.group is not None and self.chunks is None:
            self.group.close()
            raise UnsupportedModel(
                "a tensor-parallel prefill instance serves KV from each rank over UCX: it needs "
                "ucxx and cannot run with --no-ucx"
            )
        self.control_address = ""  # set once the gRPC server is bound
        self.requests_total = 0
        self.requests_aborted = 0
        self.blocks_reclaimed = 0
        self.draining = False
        self._reaper: asyncio.Task | None = None

    async def start(self, control_address: str) -> None:
        self.control_address = control_address
        self.loop.start()
        if self.chunks is not None:
            self.chunks.start(self.config.ucx_port, self.config.host)
        self._reaper = asyncio.create_task(self._reap())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self.chunks is not None:
            self.chunks.close()
        self.loop.stop()
        if self.group is not None:
            self.group.close()

    def bytes_served_by_rank(self) -> list[int]:
        followers = self.group.followers if self.group is not None else []
        return [self.source.bytes_served] + [f.bytes_served for f in followers]

    async def drain(self, timeout_s: float) -> None:
        """Refuse new prompts; let those in flight finish and their KV be pulled and released
        (the KV-transfer service keeps serving) for up to `timeout_s`; then end what is left:
        prompts still computing get UNAVAILABLE (the gateway prefills them elsewhere), held KV
        is freed (its decode instance's pull fails and the request is prefilled again)."""
        self.draining = True
        if await settle(lambda: self.loop.subscribed == 0 and not self.leases, timeout_s):
            return
        log.warning(
            "drain timed out: %d prompts in flight, %d KV handles held",
            self.loop.subscribed,
            len(self.leases),
        )
        self.loop.fail_subscribed(
            Unavailable(f"{self.config.worker_id} is shutting down and its drain timed out")
        )
        await settle(lambda: self.loop.subscribed == 0, DRAIN_SETTLE_S)
        for freeing in [self._close(lease, PromptState.DRAINED) for lease in self.leases.pop_all()]:
            await freeing

    async def prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        discard_kv: bool,
        trace: telemetry.Context | None = None,
        layerwise: asyncio.Future | None = None,
    ) -> PrefillResult:
        """Prefill a prompt; `trace` is the caller's trace context, under which the queue wait
        and the batch are recorded as spans. `layerwise` (layer-wise handoff) gets the KV
        handle as soon as the prompt is scheduled, before it is computed: its layers are
        published as they are computed, its first token when sampled."""
        if self.draining:
            raise Unavailable(
                f"{self.config.worker_id} is shutting down: send the prompt to another instance"
            )
        self.requests_total += 1
        if layerwise is not None and params.num_choices > 1:
            raise InvalidRequest(
                "a request of several choices (n, best_of) is handed off after its prefill: "
                "ask without layerwise"
            )
        if request_id in self._prompts:  # in flight, or its KV still held
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        submitted = clock.monotonic()
        queue = self.loop.subscribe(request_id)
        held = HeldPrompt(
            request_id, len(prompt), self, keep_kv=not discard_kv, trace=trace, layerwise=layerwise
        )
        self._prompts[request_id] = held
        if held.layerwise is not None:
            self.loop.layerwise.add(request_id)
        try:
            self.loop.submit(request_id, AddRequest(prompt, params, request_id))
            outs = []
            while len(outs) < params.num_choices:  # one output per choice, from one step
                out, info = await queue.get()
                if isinstance(out, EngineFailed):
                    raise Unavailable(f"prefill failed on {self.config.worker_id}: {out}")
                if isinstance(out, Exception):
                    raise out
                outs.append(out)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                self.requests_aborted += 1
            await held.abort()
            raise
        finally:
            self.loop.unsubscribe(request_id)
            self.loop.layerwise.discard(request_id)
        outs.sort(key=lambda o: o.index)
        out, others = outs[0], outs[1:]
        self.phases.record(trace, submitted, info, out.num_cached_tokens)
        first_token = out.new_token_ids[0]
        finished = all(o.finished for o in outs)
        handle = await held.computed(first_token, finished, out.held_runs)
        return PrefillResult(
            first_token=first_token,
            finish_reason=out.finish_reason,
            handle=handle,
            queue_ms=(info.started - submitted) * 1000,
            compute_ms=info.seconds * 1000,
            batch_size=info.batch_size,
            batch_tokens=info.batch_tokens,
            first_token_logprobs=out.logprobs[0] if out.logprobs else None,
            prompt_logprobs=out.prompt_logprobs,
            other_choices=tuple(
                ChoiceFirst(
                    o.new_token_ids[0], o.finish_reason, o.logprobs[0] if o.logprobs else None
                )
                for o in others
            ),
        )

    def _scheduled(self, batch: list[tuple[str, tuple]]) -> None:
        """A batch has its blocks: prompts awaiting a layer-wise handle get it now."""
        for request_id, runs in batch:
            held = self._prompts.get(request_id)
            if held is not None and held.awaits_layerwise_handle:
                held.scheduled(list(runs))

    def _layer_done(self, request_ids: list[str], layer: int) -> None:
        for request_id in request_ids:
            held = self._prompts.get(request_id)
            if held is not None:
                held.publish(layer + 1)

    async def free(self, lease: Lease) -> int:
        """Decode released a handle (the kvtransfer Release; the lease is out of the table):
        its blocks are freed once the sends still reading them are cancelled. Runs to the end
        even if the caller is cancelled meanwhile (a Release whose client gave up)."""
        return await self._close(lease, PromptState.RELEASED)

    async def abandon(self, request_id: str) -> bool:
        """The caller left without the request's result: free KV still held for it (a
        prefill that finished just as its caller was cancelled). A layer-wise lease of a
        prompt still computing is closed, and the prompt's blocks are freed when it ends."""
        lease = self.leases.pop_request(request_id)
        if lease is None:
            return False
        await self._close(lease, PromptState.ABANDONED)
        return True

    def _close(self, lease: Lease, outcome: PromptState) -> Awaitable[int]:
        """End a lease taken out of the table (its prompt's state changes now); the blocks
        freed, once they are."""
        return self._prompts[lease.request_id].close(lease, outcome)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            lapsed = [
                (lease, self._close(lease, PromptState.EXPIRED)) for lease in self.leases.expired()
            ]
            for lease, freeing in lapsed:
                freed = await freeing
                self.blocks_reclaimed += freed
                log.info("lease of %s lapsed; freed %d blocks", lease.request_id, freed)

    # -- PromptHost: what a HeldPrompt needs of this instance ---------------------------------

    async def engine_call(self, command: Release | Abort) -> int | bool:
        return await self.loop.call(command)

    def lease(self, prompt: HeldPrompt, runs: list[tuple[int, int]], layerwise: bool) -> Lease:
        """A lease on a prompt's KV; the other ranks of a tensor-parallel instance serve their
        heads of it from now on."""
        template = replace(self._template(prompt.num_tokens, runs), layerwise=layerwise)
        handle = self.leases.create(prompt.request_id, template, prompt.trace)
        if self.group is not None:
            self.group.adopt(prompt.request_id, handle.encode())
        return self.leases.get(handle.handle_id, handle.access_token)

    def lease_ended(self, lease: Lease, outcome: PromptState, blocks: int) -> None:
        """The span and histogram of the time a prompt's KV was held, with what was sent."""
        now = clock.monotonic()
        self.lease_seconds.observe(now - lease.created)
        telemetry.record(
            "kv.lease",
            lease.trace,
            lease.created,
            now,
            {
                "kv.outcome": outcome.value,
                "kv.blocks": blocks,
                "kv.chunks_sent": lease.chunks_sent,
                "kv.bytes_sent": lease.bytes_sent,
            },
        )

    def prompt_ended(self, prompt: HeldPrompt) -> None:
        del self._prompts[prompt.request_id]

    def _template(self, num_tokens: int, runs: list[tuple[int, int]]) -> KvHandle:
        kv = self.engine.kv_geometry
        cache = self.engine.runner.cache
        tp = self.config.tensor_parallel_size
        ranks = ()
        if self.group is not None:
            ports = [self.chunks.port] + [f.ucx_port for f in self.group.followers]
            ranks = tuple(
                RankSource(r, self.config.host, port, kv.heads_of(r, tp))
                for r, port in enumerate(ports)
            )
        return KvHandle(
            handle_id="",
            source_instance=self.config.worker_id,
            control_address=self.control_address,
            ucx_host=self.config.host,
            ucx_port=self.chunks.port if self.chunks is not None else 0,
            num_tokens=num_tokens,
            block_size=cache.block_size,
            num_layers=kv.num_layers,
            num_kv_heads=kv.num_kv_heads,
            head_dim=kv.head_dim,
            dtype=dtype_name(cache.data.dtype),
            runs=tuple(runs),
            # every head (a rank holds 1 / tp of them, or all of a latent)
            block_bytes=cache.block_bytes * kv.num_kv_heads // len(kv.heads_of(0, tp)),
            lease_expiry_unix_ms=0,
            access_token="",
            rank_sources=ranks,
            kv_planes=kv.planes,
        )
