"""A prefill instance: the engine in prefill-and-hold mode, leases on held KV, and the KV
transfer server (control service and UCX chunk server) that decode instances pull from."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry

from services.common import clock, telemetry
from services.common.errors import FailedPrecondition, Unavailable, UnsupportedModel
from services.common.kv_handle import KvHandle, RankSource
from services.common.metrics import EngineSteps, PrefillPhases, phase_histogram
from services.common.sampling import FinishReason, SamplingParams
from services.engine.commands import Abort, AddRequest, Release
from services.engine.shards import kv_heads_of
from services.kvtransfer.chunk_server import ChunkServer
from services.kvtransfer.faults import FaultInjector
from services.kvtransfer.leases import Lease, LeaseTable
from services.kvtransfer.memory import dtype_name
from services.kvtransfer.source import ChunkSource
from services.kvtransfer.ucx_setup import ucx_available
from services.prefill.config import PrefillConfig
from services.worker.announcer import DRAIN_SETTLE_S, settle
from services.worker.engine_loop import EngineFailed, EngineLoop
from services.worker.tp_group import start_engine

log = logging.getLogger("distserve.prefill")


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    finish_reason: FinishReason | None
    handle: KvHandle | None  # None when the request ended at its first token or KV is discarded
    queue_ms: float
    compute_ms: float
    batch_size: int
    batch_tokens: int


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
        )
        self.loop = EngineLoop(
            self.engine,
            hold=True,
            on_scheduled=self._scheduled,
            on_layer=self._layer_done,
            on_step=EngineSteps(registry).observe,
            group=self.group,
        )
        # Layer-wise handoff: requests waiting for their early handle (request id -> (future,
        # prompt tokens, trace)), and the streaming leases of prompts being computed.
        self._early: dict[str, tuple[asyncio.Future, int, object]] = {}
        self._streaming: dict[str, Lease] = {}
        self.leases = LeaseTable(config.lease_s, config.max_lease_s)
        kv = self.engine.kv_geometry
        tp = config.tensor_parallel_size
        # This rank's heads; a tensor-parallel instance's other ranks serve theirs themselves.
        self.source = ChunkSource(
            self.leases,
            self.engine.runner.cache.region,
            kv.num_layers,
            kv_heads_of(0, tp, kv.num_kv_heads),
            FaultInjector(config.kv_faults) if config.kv_faults else None,
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
            self.chunks.start(self.config.ucx_port)
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
        for lease in self.leases.pop_all():
            self._streaming.pop(lease.request_id, None)
            await self.free(lease, "drained")

    async def prefill(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        discard_kv: bool,
        trace: telemetry.Context | None = None,
        early: asyncio.Future | None = None,
    ) -> PrefillResult:
        """Prefill a prompt; `trace` is the caller's trace context, under which the queue wait
        and the batch are recorded as spans. `early` (layer-wise handoff) gets the KV handle
        as soon as the prompt is scheduled, before it is computed: its layers are published
        as they are computed, its first token when sampled."""
        if self.draining:
            raise Unavailable(
                f"{self.config.worker_id} is shutting down: send the prompt to another instance"
            )
        self.requests_total += 1
        submitted = clock.monotonic()
        queue = self.loop.subscribe(request_id)
        if early is not None and not discard_kv:
            self._early[request_id] = (early, len(prompt), trace)
            self.loop.layerwise.add(request_id)
        try:
            self.loop.submit(request_id, AddRequest(prompt, params, request_id))
            out, info = await queue.get()
            if isinstance(out, EngineFailed):
                raise Unavailable(f"prefill failed on {self.config.worker_id}: {out}")
            if isinstance(out, Exception):
                raise out
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                self.requests_aborted += 1
            await asyncio.shield(self._forget(request_id))
            raise
        finally:
            self.loop.unsubscribe(request_id)
            self._early.pop(request_id, None)
            self.loop.layerwise.discard(request_id)
        self.phases.record(trace, submitted, info, out.num_cached_tokens)
        result = dict(
            first_token=out.new_token_ids[0],
            finish_reason=out.finish_reason,
            queue_ms=(info.started - submitted) * 1000,
            compute_ms=info.seconds * 1000,
            batch_size=info.batch_size,
            batch_tokens=info.batch_tokens,
        )
        streaming = self._streaming.pop(request_id, None)
        if streaming is not None and streaming.closed:
            # Released (or lapsed) while the prompt was computed: its decode instance gave up.
            if not out.finished:
                await self.loop.call(Release(request_id))
            return PrefillResult(handle=None, **result)
        if out.finished or discard_kv:
            if streaming is not None:  # a decode instance may be pulling: nothing to decode
                streaming.first_token.set_exception(
                    FailedPrecondition(f"request {request_id} ended at its first token")
                )
                streaming.first_token.exception()  # retrieved: nobody may be waiting
                self.leases.pop_request(request_id)
                self._lease_ended(streaming, "finished", len(streaming.blocks))
            if not out.finished:
                await self.loop.call(Release(request_id))
            return PrefillResult(handle=None, **result)
        if streaming is not None:
            streaming.publish(self.engine.kv_geometry.num_layers)
            streaming.first_token.set_result((result["first_token"], clock.time_s()))
            return PrefillResult(handle=streaming.handle, **result)
        template = self._template(len(prompt), list(out.held_runs))
        handle = self._lease(request_id, template, trace)
        return PrefillResult(handle=handle, **result)

    def _lease(self, request_id: str, template: KvHandle, trace) -> KvHandle:
        """A handle on a request's KV; the other ranks of a tensor-parallel instance serve their
        heads of it from now on."""
        handle = self.leases.create(request_id, template, trace)
        if self.group is not None:
            self.group.adopt(request_id, handle.encode())
        return handle

    def _scheduled(self, batch: list[tuple[str, tuple]]) -> None:
        """A batch has its blocks: early-handle requests get their streaming handle now."""
        for request_id, runs in batch:
            waiting = self._early.pop(request_id, None)
            if waiting is None:
                continue
            future, num_tokens, trace = waiting
            if future.done():  # the caller left
                continue
            template = replace(self._template(num_tokens, list(runs)), streaming=True)
            handle = self._lease(request_id, template, trace)
            self._streaming[request_id] = self.leases.of_request(request_id)
            future.set_result(handle)

    def _layer_done(self, request_ids: list[str], layer: int) -> None:
        for request_id in request_ids:
            lease = self._streaming.get(request_id)
            if lease is not None:
                lease.publish(layer + 1)

    async def free(self, lease: Lease, outcome: str = "released") -> int:
        """Free a lease's blocks, once the sends still reading them are cancelled. The caller
        has taken the lease out of the table, so nobody else would free them: this runs to the
        end even if the caller is cancelled meanwhile (a Release whose client gave up)."""
        return await asyncio.shield(self._free(lease, outcome))

    async def _free(self, lease: Lease, outcome: str) -> int:
        await lease.stop_sends()
        freed = await self.loop.call(Release(lease.request_id))
        self._lease_ended(lease, outcome, freed)
        return freed

    def _lease_ended(self, lease: Lease, outcome: str, blocks: int) -> None:
        """The span and histogram of the time a prompt's KV was held, with what was sent."""
        now = clock.monotonic()
        self.lease_seconds.observe(now - lease.created)
        telemetry.record(
            "kv.lease",
            lease.trace,
            lease.created,
            now,
            {
                "kv.outcome": outcome,
                "kv.blocks": blocks,
                "kv.chunks_sent": lease.chunks_sent,
                "kv.bytes_sent": lease.bytes_sent,
            },
        )

    async def abandon(self, request_id: str) -> bool:
        """The caller left without the request's result: free KV still held for it (a
        prefill that finished just as its caller was cancelled). A streaming lease of a
        prompt still computing is closed, and the prompt's blocks are freed when it ends."""
        lease = self.leases.pop_request(request_id)
        if lease is None:
            return False
        await self.free(lease, "abandoned")
        return True

    async def _forget(self, request_id: str) -> None:
        """A cancelled or failed request: drop it from the engine wherever it is, and its
        lease (a streaming lease's waiters are told)."""
        self._early.pop(request_id, None)
        self._streaming.pop(request_id, None)
        lease = self.leases.pop_request(request_id)
        aborted = await self.loop.call(Abort(request_id))
        if lease is not None:
            self._lease_ended(lease, "aborted", len(lease.blocks) if aborted else 0)

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            for lease in self.leases.expired():
                freed = await self.free(lease, "expired")
                self.blocks_reclaimed += freed
                log.info("lease of %s lapsed; freed %d blocks", lease.request_id, freed)

    def _template(self, num_tokens: int, runs: list[tuple[int, int]]) -> KvHandle:
        kv = self.engine.kv_geometry
        cache = self.engine.runner.cache
        tp = self.config.tensor_parallel_size
        ranks = ()
        if self.group is not None:
            ports = [self.chunks.port] + [f.ucx_port for f in self.group.followers]
            ranks = tuple(
                RankSource(r, self.config.host, port, kv_heads_of(r, tp, kv.num_kv_heads))
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
            block_bytes=cache.block_bytes * tp,  # every head (a rank holds 1 / tp of them)
            lease_expiry_unix_ms=0,
            access_token="",
            rank_sources=ranks,
        )
