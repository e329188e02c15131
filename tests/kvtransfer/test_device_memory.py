"""What the data plane claims of KV in device memory, checked without a GPU: a source's chunk that
is a tensor (device memory) rather than a numpy view (host memory) is checksummed over gRPC from
the reply's host copy; over UCX it goes unchecksummed, and the puller says so (its report's
`unverified`) instead of passing it off as checked."""

from __future__ import annotations

import asyncio

import crc32c
import torch

from services.kvtransfer import wire
from services.kvtransfer.layout import KvDestination
from services.kvtransfer.puller import KvPuller, PullPolicy
from services.kvtransfer.servicer import KvTransferServicer
from services.kvtransfer.source import ChunkSource
from tests.kvtransfer.test_ucx_pull import serve

SHAPE = (2, 2, 4, 4, 2, 3)  # (layers, K/V, blocks, block_size, heads, head_dim)
RUNS = [(0, 3)]


def as_device_memory(monkeypatch) -> None:
    """Sources whose chunks are tensors, as a CUDA cache's are (`ChunkSource.ready`), with no
    block checksums taken (none are, of device memory)."""
    ready = ChunkSource.ready

    async def ready_on_device(self, chunk) -> None:
        await ready(self, chunk)
        chunk.data = torch.from_numpy(chunk.data)
        chunk.lease.digests.clear()

    monkeypatch.setattr(ChunkSource, "ready", ready_on_device)


def test_grpc_checksums_a_device_chunk_from_its_host_copy(monkeypatch):
    as_device_memory(monkeypatch)

    async def scenario():
        cache = torch.randn(SHAPE)
        server, handle = serve(cache, range(2), RUNS)
        servicer = KvTransferServicer(server.source.leases, free=None, source=server.source)
        try:
            request = wire.ChunkRequest(
                handle_id=handle.handle_id,
                access_token=handle.access_token,
                layer=1,
                kv=1,
                first_block=0,
                num_blocks=3,
            )
            reply = await servicer.FetchChunk(request, None)
        finally:
            server.close()
        sent = cache[1, 1, 0:3].numpy().tobytes()
        assert reply.data == sent
        assert reply.status.checksummed and list(reply.status.crc32c) == [crc32c.crc32c(sent)]

    asyncio.run(scenario())


def test_a_ucx_chunk_without_a_checksum_is_counted_unverified(monkeypatch):
    async def pull(cache: torch.Tensor) -> tuple[torch.Tensor, int]:
        server, handle = serve(cache, range(2), RUNS)
        puller = KvPuller(PullPolicy(chunk_bytes=handle.block_bytes), "ucx")
        dst = torch.zeros(SHAPE)
        try:
            report = await puller.pull(handle, [0, 1, 2], KvDestination(dst, range(2)))
        finally:
            await puller.close()
            server.close()
        return dst, report.unverified

    cache = torch.randn(SHAPE)
    dst, unverified = asyncio.run(pull(cache))
    assert torch.equal(dst[:, :, :3], cache[:, :, :3]) and unverified == 0  # host memory: checked
    # What `seal` does to a chunk in device memory: no checksum. (A tensor's bytes cannot go
    # over UCX without a GPU; the chunk stays a numpy view here.)
    monkeypatch.setattr(ChunkSource, "seal", _seal_as_device_memory)
    dst, unverified = asyncio.run(pull(cache))
    assert torch.equal(dst[:, :, :3], cache[:, :, :3]) and unverified == 2 * 2 * 3


async def _seal_as_device_memory(self, chunk) -> None:
    pass
