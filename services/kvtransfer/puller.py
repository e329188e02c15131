"""The data plane's client side: pulls a handle's KV into local blocks over UCX.

The handle's blocks and the destination blocks are paired in order; each chunk is one layer's K
or V for a range that is consecutive on both sides (at most `chunk_bytes`) and for the heads one
source rank holds and the destination wants (a tensor-parallel source serves each head range from
the rank that holds it; a tensor-parallel destination pulls, on each of its ranks, only the heads
that rank owns). A chunk is received straight into the destination region (UCX) when it covers
every head the destination holds, else into a buffer copied into place once verified; over the
gRPC fallback (hosts without ucxx) it is copied from the reply. Over UCX one request asks one
source rank for up to 32 chunks, in layer order (a message per chunk, plus the request and one
status: see chunk_server; the plan is layout.py's), over one of `lanes` connections to it, which
take turns chunk by chunk (between processes of one host the receiver copies: two lanes copy
on two cores). Up to `window` chunks are in flight (their receives posted). Each chunk in host
memory is checked against the checksum the source sends (the received bytes are hashed as each
chunk arrives, by the thread that copied it; over gRPC a chunk for device memory is hashed as it
arrives, before it is copied there; KV in device memory moves over UCX unchecksummed, counted in
the report's `unverified`) and has its own timeout; a late, failed or
corrupt chunk alone is fetched again (bounded attempts, exponential backoff with jitter, a fresh
endpoint after a transport fault).
The lease is renewed while the pull runs. A pull that gives up raises, and the caller must not
use the destination: partial KV is never decoded from.

Why one file (~500 lines): one pull, its window, retries, lease renewal and checks, share the
state of a request in flight; the transports beside it only move chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np

from services.common import clock, mesh_tls, telemetry
from services.common.errors import (
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from services.common.gen.distserve.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc
from services.common.kv_handle import KvHandle, RankSource
from services.common.server import CHANNEL_OPTIONS
from services.kvtransfer import wire
from services.kvtransfer.layout import KvDestination, PullChunk, requests_for, segments
from services.kvtransfer.memory import dtype_name, empty
from services.kvtransfer.refusals import error_of
from services.kvtransfer.transports import (
    Fetched,
    GrpcTransport,
    UcxTransport,
    Window,
)
from services.kvtransfer.ucx_setup import ucx_available

log = logging.getLogger("distserve.kvtransfer")

KV_DTYPES = ("float32", "bfloat16", "float16")  # what a handle's KV may come in
REQUESTS_AHEAD = 4  # requests in flight per source rank, at least


@dataclass(frozen=True)
class PullPolicy:
    """How a pull copes with faults."""

    # Largest chunk. Each chunk costs a fixed ~0.1-0.2 ms of CPU on each side (its UCX message,
    # futures, checksum). 64 MiB pulls over shared memory, two chunk sizes alternated in one
    # process pair: 4 MiB 3.5 GB/s, 8 MiB 4.0 (the source's CPU per pull 6.8 -> 5.0 ms); 8 and
    # 16 MiB alike (4.05 / 3.97; 5.0 / 5.2 at 256 MiB). With two lanes
    # (bench/kvtransfer/kvtransfer.py, 64 MiB): 2 MiB 4.7 GB/s, 4 MiB 5.0, 8 MiB 6.0. Small enough
    # that a retry fetches little again and a long prompt's layer still moves in several pieces.
    chunk_bytes: int = 8 * 2**20
    window: int = 32  # chunks in flight per pull (their receives posted)
    chunk_timeout_s: float = 10.0  # one attempt at one chunk
    attempts: int = 4  # per chunk, the first included
    backoff_s: float = 0.05  # first retry waits about this long, doubling each time
    verify: bool = True  # check each chunk's checksum
    # UCX connections (lanes) per source rank, each from a worker of its own: a chunk's copy
    # between processes of one host is made by the receiving worker, so with two lanes, each
    # progressed by a thread of its own, a pull copies on two cores. 0: two where this process
    # may run on two cores or more, else one, on the event loop (a `--pin` worker: a lane's
    # thread would only take turns with the loop on its one core).
    lanes: int = 0


@dataclass
class PullReport:
    """What one pull moved, and how: for its trace span and the transfer metrics."""

    transport: str
    chunks: int
    nbytes: int = 0
    retries: int = 0
    layerwise: bool = False  # pulled while prefill computed the layers
    # Chunks used without a checksum check: in device memory on either side over UCX (no host
    # copy to hash), or with `verify` off.
    unverified: int = 0
    modelled_bytes: int = 0  # an emulated engine's: the KV the payload stands for


@dataclass
class ModelledLink:
    """An emulated instance's KV link (services/engine/emulated.py): the payload moves for real,
    and a pull ends no earlier than the KV it stands for (`bytes_per_token` of the modelled
    model) takes over a link of `bytes_per_s`; pulls into the instance take turns on it, as the
    planner's simulator has them. Times are on the mesh's clock."""

    bytes_per_token: int
    bytes_per_s: float
    free_at: float = 0.0  # clock.monotonic() when the link is next free

    def reserve(self, num_tokens: int) -> float:
        """Book the link for a pull of `num_tokens` starting now; when it ends."""
        start = max(clock.monotonic(), self.free_at)
        self.free_at = start + num_tokens * self.bytes_per_token / self.bytes_per_s
        return self.free_at


class ChecksumMismatch(Exception):
    """A chunk arrived with bytes that do not match the source's checksum."""


class KvPuller:
    """Pulls KV from prefill instances over UCX, or gRPC where UCX is not available."""

    def __init__(
        self,
        policy: PullPolicy | None = None,
        transport: str = "auto",
        link: ModelledLink | None = None,
    ) -> None:
        """`link`: an emulated instance's modelled link (None: the pull takes what it takes)."""
        if transport not in ("auto", "ucx", "grpc"):
            raise InvalidRequest("transport must be auto, ucx or grpc")
        self.policy = policy or PullPolicy()
        self.link = link
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._grpc = GrpcTransport(self._channel)
        self._ucx = None
        if transport == "ucx" or (transport == "auto" and ucx_available()):
            lanes = self.policy.lanes or (2 if len(os.sched_getaffinity(0)) > 1 else 1)
            self._ucx = UcxTransport(lanes)
        elif transport == "auto":
            log.warning("ucxx is not importable: KV moves over the gRPC fallback (slower)")
        self.chunks_retried = 0
        self.checksum_failures = 0
        self.lease_renewals = 0

    async def warm_up(self, host: str = "127.0.0.1") -> None:
        """Pay the data plane's one-time set-up now rather than in the first pull; `host` is
        an address of this process's (the one it serves on: UCX may be limited to its
        device)."""
        if self._ucx is not None:
            try:
                await self._ucx.warm_up(host)
            except Exception as e:  # the first pull will show whether UCX works
                log.warning("UCX warm-up failed: %s", e)

    @property
    def reconnects(self) -> int:
        return self._ucx.reconnects if self._ucx is not None else 0

    def transport_for(self, handle: KvHandle, source: RankSource):
        """UCX when both sides have it, else the gRPC fallback, which serves rank 0's heads
        only (a tensor-parallel source's other ranks serve over UCX alone)."""
        if self._ucx is not None and source.ucx_port:
            return self._ucx
        if source.rank == 0 and self._grpc.serves(handle):
            return self._grpc
        raise FailedPrecondition(
            f"KV heads {source.heads.start}..{source.heads.stop - 1} of "
            f"{handle.source_instance} are served by its rank {source.rank} over UCX only, and "
            "this instance has no UCX (ucxx is not importable, or --kv-transport grpc)"
        )

    def _pieces(self, handle: KvHandle, dst: KvDestination) -> list[tuple[RankSource, range]]:
        """(source rank, heads) for each rank holding some of the heads the destination wants,
        each head from the first rank that holds it (every rank holds all of a latent)."""
        pieces = []
        taken = dst.heads.start  # the heads before it have a source
        for source in handle.sources():
            lo = max(source.heads.start, taken)
            hi = min(source.heads.stop, dst.heads.stop)
            if lo < hi:
                pieces.append((source, range(lo, hi)))
                taken = hi
        if sum(len(h) for _, h in pieces) != len(dst.heads):
            raise InvalidRequest(
                f"the handle's sources do not hold KV heads {dst.heads.start}.."
                f"{dst.heads.stop - 1} (it has {handle.num_kv_heads} heads)"
            )
        return pieces

    async def pull(
        self,
        handle: KvHandle,
        dst_blocks: list[int],
        dst: KvDestination,
        trace: telemetry.Context | None = None,
        skip: int = 0,
    ) -> PullReport:
        """Fill dst_blocks of `dst` with the handle's KV for the heads `dst` holds, from the
        handle's block `skip` on (the first `skip` blocks are already in place: a prefix the
        destination had cached); returns what was moved. `trace` (the pull's span) travels with
        the lease renewals to the source.

        Raises Unavailable when the source cannot be reached or a chunk runs out of attempts,
        PermissionDenied or NotFound when the source refuses the handle.
        """
        tokens = max(0, handle.num_tokens - skip * handle.block_size)  # those moved
        ends = self.link.reserve(tokens) if self.link is not None else None
        src_blocks = handle.blocks()[skip:]
        if skip < 0 or len(src_blocks) != len(dst_blocks):
            raise InvalidRequest(
                f"handle has {len(handle.blocks())} blocks, {skip} of them in place, "
                f"destination {len(dst_blocks)}"
            )
        pieces = [
            (self.transport_for(handle, source), source, heads)
            for source, heads in self._pieces(handle, dst)
        ]
        chunks = []
        for transport, source, heads in pieces:
            piece_block_bytes = handle.block_bytes * len(heads) // handle.num_kv_heads
            per_chunk = max(1, self.policy.chunk_bytes // max(1, piece_block_bytes))
            segs = [(i + skip, d, n) for i, d, n in segments(src_blocks, dst_blocks, per_chunk)]
            plan = [
                (layer, kv, seg)
                for layer in range(handle.num_layers)
                for kv in range(handle.kv_planes)
                for seg in segs
            ]
            # the lanes take turns, chunk by chunk in layer order
            chunks += [
                PullChunk(layer, kv, seg, transport, source, heads, i % transport.lanes)
                for i, (layer, kv, seg) in enumerate(plan)
            ]
        batches = requests_for(chunks)  # layer by layer: early layers are computed first
        # The window shared out between the lanes: one window for all let the first lane's
        # request take every place (its chunks ask first), and a 1 GiB pull was copied by one
        # lane alone for its first 32 chunks (~80 ms).
        lanes = max((t.lanes for t, _, _ in pieces), default=1)
        windows = [Window(max(1, self.policy.window // lanes)) for _ in range(lanes)]
        # Requests in flight per transport: enough to keep the window full (one chunk each
        # over gRPC), and over UCX several ahead: a request's first chunk comes a round trip
        # and the source's set-up after it goes out, so the next requests are out while one's
        # chunks arrive (with 2 in flight, the third of a 96-chunk pull waited for the first
        # to end: ~1.3 ms of an empty window).
        requests = {
            t: asyncio.Semaphore(max(REQUESTS_AHEAD, -(-self.policy.window // t.max_chunks)))
            for t, _, _ in pieces
        }
        names = sorted({transport.name for transport, _, _ in pieces})
        report = PullReport("+".join(names), len(chunks), layerwise=handle.layerwise)

        stop = asyncio.Event()  # a chunk failed or the pull was cancelled: start no more

        async def one(batch: list[PullChunk]) -> int:
            async with requests[batch[0].transport]:
                if stop.is_set():
                    return 0
                try:
                    window = windows[batch[0].lane]
                    return await self._batch(handle, dst, report, stop, window, batch)
                except BaseException:
                    stop.set()
                    raise

        renewer = asyncio.ensure_future(self._keep_lease(handle, trace))
        tasks = [asyncio.ensure_future(one(batch)) for batch in batches]
        try:
            # Chunks in flight are never cancelled when another fails: the source answers each
            # (data, or a refusal once the lease ended), and an abandoned UCX receive is a
            # hazard (see UcxTransport). They settle, then the first error is raised.
            results = await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
        except asyncio.CancelledError:
            # The request was cancelled: stop starting chunks and let those in flight settle
            # (each is bounded by its timeout) before the destination may be reused.
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            renewer.cancel()
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        report.nbytes = sum(results)
        if ends is not None:
            report.modelled_bytes = tokens * self.link.bytes_per_token
            await clock.sleep(ends - clock.monotonic())
        return report

    async def _batch(
        self,
        handle: KvHandle,
        dst: KvDestination,
        report: PullReport,
        stop: asyncio.Event,
        window: Window,
        batch: list[PullChunk],
    ) -> int:
        """Chunks from one source rank, in one request where the transport allows; each with
        its own timeout, and those late, broken or corrupt fetched
        again on their own; no new attempt once `stop` is set (the pull fails or was cancelled
        anyway). Returns the bytes moved."""
        policy = self.policy
        first = batch[0]
        transport, source, heads = first.transport, first.source, first.heads
        where = f"{handle.source_instance} rank {source.rank} over {transport.name}"
        for c in batch:
            c.buffer, c.land = dst.region(c.layer, c.kv, c.seg[1], c.seg[2], heads)
        todo = batch
        error: BaseException | None = None
        for attempt in range(policy.attempts):
            if attempt:
                if stop.is_set():
                    raise Unavailable(f"KV pull from {where} stopped: {error}")
                self.chunks_retried += len(todo)
                report.retries += len(todo)
                # Exponential backoff with jitter, so retries of many chunks spread out.
                await asyncio.sleep(policy.backoff_s * 2 ** (attempt - 1) * (0.5 + random.random()))
            request = wire.ChunkRequest(
                handle_id=handle.handle_id,
                access_token=handle.access_token,
                first_head=heads.start,
                num_heads=len(heads),
                chunks=[
                    wire.ChunkRange(
                        layer=c.layer, kv=c.kv, first_block=c.seg[0], num_blocks=c.seg[2]
                    )
                    for c in todo
                ],
            )
            # Over gRPC every chunk comes through host memory, where it is hashed; over UCX
            # only chunks received into host memory are.
            verify = policy.verify and (
                isinstance(first.buffer, np.ndarray) or isinstance(transport, GrpcTransport)
            )
            try:
                fetched = await transport.fetch(
                    handle,
                    source,
                    request,
                    [c.buffer for c in todo],
                    window,
                    policy.chunk_timeout_s,
                    verify,
                    first.lane,
                )
            except Unavailable as e:  # cannot connect
                fetched = Fetched(None, [e] * len(todo), [None] * len(todo))
            status = fetched.status
            if status is not None:
                if not status.ok:
                    raise error_of(status)
                expected = sum(c.buffer.nbytes for c in todo)
                if status.nbytes != expected:
                    raise InvalidRequest(f"chunks of {status.nbytes} bytes for {expected}")
            failed = []
            for i, chunk in enumerate(todo):
                if fetched.errors[i] is not None or status is None:
                    error = fetched.errors[i] or Exception("no status came for the chunk")
                    failed.append(chunk)
                    continue
                if verify and status.checksummed and fetched.digests[i] != _nth(status.crc32c, i):
                    self.checksum_failures += 1
                    error = ChecksumMismatch(
                        f"layer {chunk.layer} kv {chunk.kv}: checksum mismatch"
                    )
                    failed.append(chunk)
                    continue
                if chunk.land is not None:
                    chunk.land()
            if status is not None and not (verify and status.checksummed):
                report.unverified += len(todo) - len(failed)
            if not failed:
                return sum(c.buffer.nbytes for c in batch)
            log.warning(
                "%d KV chunk(s) from %s failed (attempt %d of %d), first layer %d kv %d: %s",
                len(failed),
                where,
                attempt + 1,
                policy.attempts,
                failed[0].layer,
                failed[0].kv,
                error,
            )
            todo = failed
        raise Unavailable(f"KV pull from {where} failed after {policy.attempts} attempts: {error}")

    @contextlib.asynccontextmanager
    async def holding(
        self, handle: KvHandle, trace: telemetry.Context | None = None
    ) -> AsyncIterator[None]:
        """Renew the handle's lease while inside (a request waiting for room to pull into, so
        that its KV is still there when the room comes)."""
        renewer = asyncio.ensure_future(self._keep_lease(handle, trace))
        try:
            yield
        finally:
            renewer.cancel()

    async def _keep_lease(self, handle: KvHandle, trace: telemetry.Context | None) -> None:
        """Renew the handle's lease while the pull runs, well before it lapses (most pulls end
        before the first renewal: nothing is set up until then)."""
        expiry_ms = handle.lease_expiry_unix_ms
        stub = access = None
        while True:
            remaining = expiry_ms / 1000 - time.time()
            await asyncio.sleep(max(0.05, remaining / 3))
            if stub is None:
                stub = kvtransfer_pb2_grpc.KvTransferStub(self._channel(handle.control_address))
                access = kvtransfer_pb2.KvAccess(
                    handle_id=handle.handle_id, access_token=handle.access_token
                )
            try:
                renewed = await stub.RenewLease(
                    kvtransfer_pb2.RenewLeaseRequest(access=access),
                    timeout=5,
                    metadata=telemetry.outgoing(trace),
                )
            except grpc.aio.AioRpcError as e:
                log.warning("lease renewal of %s failed: %s", handle.handle_id, e.code().name)
                continue
            expiry_ms = renewed.lease_expiry_unix_ms
            self.lease_renewals += 1

    async def pull_into(
        self,
        handle: KvHandle,
        cache,
        blocks: list[int],
        heads: range,
        trace: telemetry.Context | None = None,
        skip: int = 0,
    ) -> PullReport:
        """Fill `blocks` of an engine's KV cache (a KvCache holding the global KV heads `heads`)
        with the handle's KV, from its block `skip` on (`blocks` are for those; the first
        `skip` are in place already). KV in another block size or dtype is pulled whole into a
        staging buffer in the source's layout and converted into place (`skip` must be 0)."""
        if (handle.block_size, handle.dtype) == (cache.block_size, dtype_name(cache.data.dtype)):
            return await self.pull(handle, blocks, KvDestination(cache.data, heads), trace, skip)
        if skip:
            raise InvalidRequest("KV in another block size or dtype is pulled whole (skip 0)")
        n, h = handle.num_blocks, len(heads)
        staging = empty(
            (handle.num_layers, handle.kv_planes, n, handle.block_size, h, handle.head_dim),
            handle.dtype,
            like=cache.data,
        )
        report = await self.pull(handle, list(range(n)), KvDestination(staging, heads), trace)
        for layer in range(handle.num_layers):
            for kv in range(handle.kv_planes):
                tokens = staging[layer, kv].reshape(-1, h, handle.head_dim)[: handle.num_tokens]
                cache.write_tokens(layer, kv, blocks, tokens)
        return report

    async def first_token(
        self, handle: KvHandle, trace: telemetry.Context | None = None
    ) -> tuple[int, float]:
        """A layer-wise handle's first token, once prefill sampled it, and when prefill finished
        (unix s). FailedPrecondition if it ended the request; NotFound if the handle is gone;
        Unavailable if the source cannot be reached."""
        stub = kvtransfer_pb2_grpc.KvTransferStub(self._channel(handle.control_address))
        access = kvtransfer_pb2.KvAccess(
            handle_id=handle.handle_id, access_token=handle.access_token
        )
        try:
            reply = await stub.AwaitFirstToken(access, metadata=telemetry.outgoing(trace))
        except grpc.aio.AioRpcError as e:
            error = {
                grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
                grpc.StatusCode.NOT_FOUND: NotFound,
                grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
            }.get(e.code(), Unavailable)
            raise error(f"first token from {handle.source_instance}: {e.details()}") from e
        return reply.token_id, reply.prefill_done_unix_s

    async def release(self, handle: KvHandle, trace: telemetry.Context | None = None) -> int:
        """Tell the source to free the handle's KV; returns the blocks it freed: 0 when the
        handle is already gone (the source freed it when the request finished at its first
        token, or its lease lapsed, which the source counts)."""
        stub = kvtransfer_pb2_grpc.KvTransferStub(self._channel(handle.control_address))
        access = kvtransfer_pb2.KvAccess(
            handle_id=handle.handle_id, access_token=handle.access_token
        )
        try:
            reply = await stub.Release(access, timeout=10, metadata=telemetry.outgoing(trace))
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return 0
            raise
        return reply.blocks_freed

    async def close(self) -> None:
        if self._ucx is not None:
            await self._ucx.close()
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = mesh_tls.aio_channel(address, CHANNEL_OPTIONS)
            self._channels[address] = channel
        return channel


def _nth(checksums, i: int) -> int | None:
    """Chunk i's checksum as the source sent it; None (no match: the chunk is fetched again,
    then the pull gives up) from a source that sent too few, e.g. one of an older version."""
    return checksums[i] if i < len(checksums) else None
