"""The serving side of the data plane, independent of the transport.

`ChunkSource.open` checks a KvChunkRequest (lease, access token, layer, block ranges) and returns
each chunk's region to send (`seal` adds its checksum) with, when fault injection is on, the
fault that hits it; `status` is the answer for them all. The checksums (CRC-32C) of KV in host
memory are made when it is computed: as a lease's layers are published, each block's is taken
once (on a checksum thread), and a chunk's is combined from its blocks' (`crc_combine.combine`,
~10 us for 128 blocks), the same value as a pass over its bytes, which is how the puller checks
it; so no pass over the bytes is left for the moment they are sent. A chunk of a sub-range of
the heads (a copy) is hashed as it is sent. The UCX server and the gRPC fallback both serve
through it and bracket the sends with `sending`, so that held blocks are never freed
under a send in progress.

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
from typing import Any

import numpy as np

from services.common.errors import DeadlineExceeded, InvalidRequest
from services.kvtransfer import checksums, crc_combine, wire
from services.kvtransfer.faults import Fault, FaultInjector
from services.kvtransfer.leases import Lease, LeaseTable
from services.kvtransfer.memory import contiguous, on_host, raw

log = logging.getLogger("distserve.kvtransfer")

SEND_TIMEOUT_S = 30.0  # longest one chunk send may wait for its receiver

# region(layer, kv, first_block_id, num_blocks) -> those blocks of one layer's K or V in place,
# (num_blocks, block_size, heads held here, head_dim): a numpy array or a torch tensor
RegionFn = Callable[[int, int, int, int], Any]
ADOPT_WAIT_S = 5.0  # how long a follower rank's source waits for a handle rank 0 has announced


@dataclass
class Chunk:
    """A chunk about to be sent: its layer, its bytes once the layer is computed (`ready`), an
    injected fault, if any, and its checksum once sealed."""

    lease: Lease
    layer: int
    kv: int
    index: int  # of its first block in the handle's block list
    region: Any  # (blocks, block_size, heads, head_dim) in place
    heads: range  # the heads asked for
    fault: Fault | None
    data: object = None  # numpy uint8 view (host memory) or uint8 tensor (device memory)
    checksum: int | None = None


def ranges(req) -> list[tuple[int, int, int, int]]:
    """(layer, kv, first block index, blocks) of each chunk a request asks for."""
    return [(c.layer, c.kv, c.first_block, c.num_blocks) for c in req.chunks] or [
        (req.layer, req.kv, req.first_block, req.num_blocks)
    ]


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
        planes: int = 2,
    ) -> None:
        """`heads`: the global KV heads `region` holds. `adopt_wait_s`: how long a request for
        an unknown handle waits for it to appear (a follower rank learns of handles from rank
        0, a moment after the puller may). `planes`: per layer, K and V (2) or a latent (1)."""
        self.leases = leases
        self.region = region
        self.heads = heads
        self.planes = planes
        self.num_layers = num_layers
        self.adopt_wait_s = adopt_wait_s
        self.faults = faults  # tests and drills only
        self.chunks_served = 0
        self.bytes_served = 0
        leases.on_publish = self._published
        block = region(0, 0, 0, 1)
        if on_host(block):  # what `seal` combines blocks' CRCs with (~50 ms, once)
            crc_combine.prepare(block.nbytes)

    async def open_when_ready(self, req) -> list[Chunk]:
        """`open` (a follower rank first waits up to adopt_wait_s for the handle to appear)."""
        if self.adopt_wait_s:
            await self.leases.wait_for(req.handle_id, self.adopt_wait_s)
        return self.open(req)

    def open(self, req) -> list[Chunk]:
        """The chunks a request asks for, to be sent once `ready`; DistServeError (NotFound,
        PermissionDenied, InvalidRequest) when it may not have them."""
        lease = self.leases.get(req.handle_id, req.access_token)
        asked = ranges(req)
        if len(asked) > wire.MAX_CHUNKS:
            raise InvalidRequest(f"{len(asked)} chunks in one request (at most {wire.MAX_CHUNKS})")
        heads = self._heads(req)
        chunks = []
        for layer, kv, index, n in asked:
            if not (0 <= layer < self.num_layers and 0 <= kv < self.planes):
                raise InvalidRequest(f"no layer {layer} / kv {kv}")
            region = self.region(layer, kv, self._check(index, n, lease.blocks), n)
            chunks.append(Chunk(lease, layer, kv, index, region, heads, self._fault()))
        return chunks

    def _published(self, lease: Lease, before: int, after: int) -> None:
        """Layers before..after-1 of a lease are computed: take their blocks' checksums, on a
        checksum thread, unless the KV is in device memory."""
        if not lease.blocks or not on_host(self.region(0, 0, lease.blocks[0], 1)):
            return
        for layer in range(before, after):
            lease.digests[layer] = checksums.on_checksum_thread(self._block_digests, lease, layer)

    def _block_digests(self, lease: Lease, layer: int) -> list[np.ndarray]:
        """CRC-32C of each of the lease's blocks of one layer, per plane, in block list order."""
        out = []
        for kv in range(self.planes):
            digests = []
            for first, n in lease.handle.runs:
                rows = raw(self.region(layer, kv, first, n)).reshape(n, -1)
                digests += [checksums.checksum_of(row) for row in rows]
            out.append(np.array(digests, dtype=np.uint32))
        return out

    async def ready(self, chunk: Chunk) -> None:
        """Wait until the chunk's layer is computed (a layer-wise handle's layers are published
        as prefill computes them; the wait ends early if the lease closes), then take its
        bytes: in place, or a contiguous copy of a sub-range of the heads."""
        lease = chunk.lease
        if lease.layers_ready <= chunk.layer < self.num_layers:
            try:
                await asyncio.wait_for(lease.wait_layer(chunk.layer), SEND_TIMEOUT_S)
            except TimeoutError:
                raise DeadlineExceeded(
                    f"layer {chunk.layer} was not computed within {SEND_TIMEOUT_S} s"
                ) from None
        region = chunk.region
        if chunk.heads != self.heads:  # a sub-range: strided in the cache, sent as a copy
            lo = chunk.heads.start - self.heads.start
            region = contiguous(region[:, :, lo : lo + len(chunk.heads)])
        chunk.data = raw(region)

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

    def _fault(self) -> Fault | None:
        fault = self.faults.next_chunk() if self.faults is not None else None
        if fault is not None:
            log.warning("injecting fault %s on chunk %d", fault.kind, fault.at)
        return fault

    async def seal(self, chunk: Chunk) -> None:
        """The checksum of a chunk in host memory: combined from its blocks' when the layer's
        are taken (all the heads the source holds), else of its bytes. A chunk in device memory
        gets none (UCX moves it GPU to GPU; no host copy to hash): its status then says it is
        not checksummed, and the puller counts it unverified. Inside `sending`: it may read the
        blocks."""
        if not isinstance(chunk.data, np.ndarray):
            return
        digests = chunk.lease.digests.get(chunk.layer) if chunk.heads == self.heads else None
        if digests is not None:
            n = chunk.region.shape[0]
            blocks = (await digests)[chunk.kv][chunk.index : chunk.index + n]
            chunk.checksum = crc_combine.combine(blocks, chunk.data.nbytes // n)
        else:
            chunk.checksum = await checksums.checksum(chunk.data)

    @staticmethod
    def status(chunks: list[Chunk]) -> wire.ChunkStatus:
        """The answer for sealed chunks: their size and checksums."""
        checksummed = all(c.checksum is not None for c in chunks)
        return wire.ChunkStatus(
            ok=True,
            nbytes=sum(c.data.nbytes for c in chunks),
            checksummed=checksummed,
            crc32c=[c.checksum for c in chunks] if checksummed else [],
        )

    @contextlib.contextmanager
    def sending(self, chunks: list[Chunk]) -> Iterator[None]:
        """Marks the chunks' blocks as being read while their sends run (a release cancels
        the sends and waits for them before the blocks are freed)."""
        task = asyncio.current_task()
        lease = chunks[0].lease
        lease.begin_send(task)
        try:
            yield
        finally:
            lease.end_send(task)

    def served(self, chunk: Chunk) -> None:
        self.chunks_served += 1
        self.bytes_served += chunk.data.nbytes
        chunk.lease.chunks_sent += 1
        chunk.lease.bytes_sent += chunk.data.nbytes

    @staticmethod
    def _check(index: int, n: int, blocks: list[int]) -> int:
        """The first block id of a chunk's range, if the range is valid and contiguous."""
        end = index + n
        if n == 0 or end > len(blocks):
            raise InvalidRequest(f"blocks {index}..{end} outside the handle's {len(blocks)}")
        first = blocks[index]
        if blocks[index:end] != list(range(first, first + n)):
            raise InvalidRequest("a chunk must cover consecutive blocks")
        return first
