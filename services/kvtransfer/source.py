"""The serving side of the data plane, independent of the transport.

`ChunkSource.open` checks a KvChunkRequest (lease, access token, layer, block range), returns the
region to send with its status (size; `seal` adds the xxh3-64 checksum) and, when fault injection
is on, the fault that hits it. The UCX server and the gRPC fallback both serve through it and
bracket each send with `sending`, so that held blocks are never freed under a send in progress.

A source holds a range of KV heads (all of them on a single-rank instance; its own share on a
rank of a tensor-parallel one, which serves it on a listener of its own). A request may ask for
a sub-range: that is sent as a contiguous copy, the whole range in place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from services.common.errors import DeadlineExceeded, InvalidRequest
from services.kvtransfer import wire
from services.kvtransfer.faults import Fault, FaultInjector
from services.kvtransfer.leases import Lease, LeaseTable

log = logging.getLogger("distserve.kvtransfer")

SEND_TIMEOUT_S = 30.0  # longest one chunk send may wait for its receiver

# region(layer, kv, first_block_id, num_blocks) -> those blocks of one layer's K or V in place,
# (num_blocks, block_size, heads held here, head_dim)
RegionFn = Callable[[int, int, int, int], torch.Tensor]
ADOPT_WAIT_S = 5.0  # how long a follower rank's source waits for a handle rank 0 has announced


@dataclass
class Chunk:
    """A chunk about to be sent: its bytes, its status frame and an injected fault, if any."""

    lease: Lease
    data: object  # numpy uint8 view (host memory) or uint8 tensor (device memory)
    status: wire.ChunkStatus
    fault: Fault | None


class ChunkSource:
    """Chunks of held KV for holders of a valid handle."""

    def __init__(
        self,
        leases: LeaseTable,
        region: RegionFn,
        num_layers: int,
        heads: range,
        faults: FaultInjector | None = None,
        adopt_wait_s: float = 0.0,
    ) -> None:
        """`heads`: the global KV heads `region` holds. `adopt_wait_s`: how long a request for
        an unknown handle waits for it to appear (a follower rank learns of handles from rank
        0, a moment after the puller may)."""
        self.leases = leases
        self.region = region
        self.heads = heads
        self.num_layers = num_layers
        self.adopt_wait_s = adopt_wait_s
        self.faults = faults  # tests and drills only
        self.chunks_served = 0
        self.bytes_served = 0

    async def open_when_ready(self, req) -> Chunk:
        """`open`, once the chunk's layer is computed (a streaming handle's layers are
        published as prefill computes them; the wait ends early if the lease closes)."""
        if self.adopt_wait_s:
            await self.leases.wait_for(req.handle_id, self.adopt_wait_s)
        lease = self.leases.get(req.handle_id, req.access_token)
        if lease.layers_ready <= req.layer < self.num_layers:
            try:
                await asyncio.wait_for(lease.wait_layer(req.layer), SEND_TIMEOUT_S)
            except TimeoutError:
                raise DeadlineExceeded(
                    f"layer {req.layer} was not computed within {SEND_TIMEOUT_S} s"
                ) from None
        return self.open(req)

    def open(self, req) -> Chunk:
        """The chunk a request asks for; DistServeError (NotFound, PermissionDenied,
        InvalidRequest) when it may not have it."""
        lease = self.leases.get(req.handle_id, req.access_token)
        first = self._check(req, lease.blocks)
        heads = self._heads(req)
        region = self.region(req.layer, req.kv, first, req.num_blocks)
        if heads != self.heads:  # a sub-range: strided in the cache, sent as a copy
            lo = heads.start - self.heads.start
            region = region[:, :, lo : lo + len(heads)].contiguous()
        data = region.reshape(-1).view(torch.uint8)
        return self._chunk(lease, data.numpy() if data.device.type == "cpu" else data)

    def _heads(self, req) -> range:
        if req.num_heads == 0:
            return self.heads
        heads = range(req.first_head, req.first_head + req.num_heads)
        if heads.start < self.heads.start or heads.stop > self.heads.stop:
            raise InvalidRequest(
                f"KV heads {heads.start}..{heads.stop - 1} asked of a source that holds "
                f"{self.heads.start}..{self.heads.stop - 1}"
            )
        return heads

    def _chunk(self, lease: Lease, data) -> Chunk:
        status = wire.ChunkStatus(ok=True, nbytes=data.nbytes)
        fault = self.faults.next_chunk() if self.faults is not None else None
        if fault is not None:
            log.warning("injecting fault %s on chunk %d", fault.kind, fault.at)
        return Chunk(lease, data, status, fault)

    async def seal(self, chunk: Chunk) -> None:
        """Put the checksum of a chunk in host memory into its status (device memory goes
        unchecksummed: UCX moves it GPU to GPU). Inside `sending`: it reads the blocks."""
        if isinstance(chunk.data, np.ndarray):
            chunk.status.checksum = await wire.checksum(chunk.data)
            chunk.status.checksummed = True

    @contextlib.contextmanager
    def sending(self, chunk: Chunk) -> Iterator[None]:
        """Marks the chunk's blocks as being read while its send runs (a release cancels the
        send and waits for it before the blocks are freed)."""
        task = asyncio.current_task()
        chunk.lease.begin_send(task)
        try:
            yield
        finally:
            chunk.lease.end_send(task)

    def served(self, chunk: Chunk) -> None:
        self.chunks_served += 1
        self.bytes_served += chunk.data.nbytes
        chunk.lease.chunks_sent += 1
        chunk.lease.bytes_sent += chunk.data.nbytes

    def _check(self, req, blocks: list[int]) -> int:
        """The first block id of the request's range, if the range is valid and contiguous."""
        if req.layer >= self.num_layers or req.kv > 1:
            raise InvalidRequest(f"no layer {req.layer} / kv {req.kv}")
        end = req.first_block + req.num_blocks
        if req.num_blocks == 0 or end > len(blocks):
            raise InvalidRequest(
                f"blocks {req.first_block}..{end} outside the handle's {len(blocks)}"
            )
        first = blocks[req.first_block]
        if blocks[req.first_block : end] != list(range(first, first + req.num_blocks)):
            raise InvalidRequest("a chunk must cover consecutive blocks")
        return first


def corrupted(data: np.ndarray) -> np.ndarray:
    """A copy of the data with one byte flipped (the `corrupt` fault)."""
    out = np.array(data, copy=True)
    out[len(out) // 2] ^= 0xFF
    return out
