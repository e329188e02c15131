"""KV split by heads (tensor parallelism) moves rank to rank over real UCX: each destination gets
exactly the heads it holds, from the source ranks that hold them, bit for bit."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import torch

from services.common.errors import InvalidRequest
from services.common.kv_handle import KvHandle, RankSource
from services.kvtransfer.chunk_server import ChunkServer
from services.kvtransfer.faults import FaultInjector
from services.kvtransfer.layout import KvDestination
from services.kvtransfer.leases import LeaseTable
from services.kvtransfer.puller import KvPuller, PullPolicy
from services.kvtransfer.source import ChunkSource

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 2, 8, 4, 4, 8
SRC_BLOCKS = [1, 2, 3, 6, 7]  # where the prompt lies at the source
DST_BLOCKS = [0, 4, 5, 6, 2]  # where it goes


def _cache(heads: int) -> torch.Tensor:
    return torch.zeros(LAYERS, 2, BLOCKS, BLOCK_SIZE, heads, HEAD_DIM)


async def _serve(full: torch.Tensor, tp: int, faults: str = ""):
    """A source of `tp` ranks over `full`'s KV, each on its own listener with its own lease
    table (rank 0 makes the handle, the others adopt it; `faults` are injected on rank 0);
    returns (handle, servers)."""
    per = HEADS // tp
    servers, tables = [], []
    for r in range(tp):
        shard = full[:, :, :, :, r * per : (r + 1) * per].contiguous()
        table = LeaseTable(default_s=30, max_s=60)
        source = ChunkSource(
            table,
            lambda layer, kv, first, n, s=shard: s[layer, kv, first : first + n],
            LAYERS,
            range(r * per, (r + 1) * per),
            FaultInjector(faults) if faults and r == 0 else None,
        )
        servers.append(ChunkServer(source))
        servers[-1].start()
        tables.append(table)
    ranks = tuple(
        RankSource(r, "127.0.0.1", s.port, range(r * per, (r + 1) * per))
        for r, s in enumerate(servers)
    )
    template = KvHandle(
        handle_id="",
        source_instance="prefill-tp",
        control_address="",
        ucx_host="127.0.0.1",
        ucx_port=servers[0].port,
        num_tokens=len(SRC_BLOCKS) * BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        num_layers=LAYERS,
        num_kv_heads=HEADS,
        head_dim=HEAD_DIM,
        dtype="float32",
        runs=((1, 3), (6, 2)),
        block_bytes=BLOCK_SIZE * HEADS * HEAD_DIM * 4,
        lease_expiry_unix_ms=0,
        access_token="",
        rank_sources=ranks if tp > 1 else (),
    )
    handle = tables[0].create("r", template)
    for table in tables[1:]:
        table.adopt("r", handle, LAYERS)
    return handle, servers


@pytest.mark.parametrize(
    ("source_tp", "dst_heads"),
    [
        (2, range(0, 4)),  # tp=2 source -> tp=1 destination: both ranks, one piece each
        (2, range(2, 4)),  # tp=2 -> rank 1 of tp=2: one source rank, straight into place
        (2, range(1, 3)),  # straddling both source ranks: a piece of each, copied into place
        (1, range(2, 4)),  # tp=1 source -> rank 1 of tp=2: a sub-range of the source's heads
        (4, range(0, 2)),  # tp=4 -> rank 0 of tp=2: two source ranks
    ],
)
def test_each_destination_gets_exactly_its_heads(source_tp, dst_heads):
    full = torch.randn(LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)

    async def scenario():
        handle, servers = await _serve(full, source_tp)
        dst = _cache(len(dst_heads))
        puller = KvPuller(PullPolicy(chunk_bytes=2 * BLOCK_SIZE * HEAD_DIM * 4, window=3), "ucx")
        try:
            report = await puller.pull(handle, DST_BLOCKS, KvDestination(dst, dst_heads))
        finally:
            await puller.close()
            for s in servers:
                s.close()
        return dst, report, servers, handle

    dst, report, servers, handle = asyncio.run(scenario())
    want = full[:, :, SRC_BLOCKS][:, :, :, :, dst_heads.start : dst_heads.stop]
    assert torch.equal(dst[:, :, DST_BLOCKS], want)
    untouched = [b for b in range(BLOCKS) if b not in DST_BLOCKS]
    assert not dst[:, :, untouched].any()
    assert report.nbytes == handle.total_bytes * len(dst_heads) // HEADS
    # Only the ranks holding wanted heads were asked.
    per = HEADS // source_tp
    asked = [r for r, s in enumerate(servers) if s.source.chunks_served]
    assert asked == sorted({h // per for h in dst_heads})


def test_heads_a_source_does_not_hold_are_refused():
    full = torch.randn(LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)

    async def scenario():
        handle, servers = await _serve(full, 2)
        # A handle that (wrongly) says rank 1 holds every head.
        wrong = handle.rank_sources[1]
        lying = replace(
            handle, rank_sources=(RankSource(1, wrong.ucx_host, wrong.ucx_port, range(HEADS)),)
        )
        puller = KvPuller(PullPolicy(), "ucx")
        try:
            with pytest.raises(
                InvalidRequest, match=r"KV heads 0\.\.3 asked of a source that holds"
            ):
                await puller.pull(lying, DST_BLOCKS, KvDestination(_cache(HEADS), range(HEADS)))
        finally:
            await puller.close()
            for s in servers:
                s.close()

    asyncio.run(scenario())


def test_a_handle_missing_some_heads_is_refused_before_any_transfer():
    full = torch.randn(LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)

    async def scenario():
        handle, servers = await _serve(full, 2)
        half = replace(handle, rank_sources=handle.rank_sources[:1])
        puller = KvPuller(PullPolicy(), "ucx")
        try:
            with pytest.raises(InvalidRequest, match=r"do not hold KV heads 0\.\.3"):
                await puller.pull(half, DST_BLOCKS, KvDestination(_cache(HEADS), range(HEADS)))
        finally:
            await puller.close()
            for s in servers:
                s.close()
        assert not any(s.source.chunks_served for s in servers)

    asyncio.run(scenario())


@pytest.mark.parametrize("skip", [1, 3, 4])
def test_a_pull_that_skips_a_cached_prefix_moves_only_the_rest(skip):
    """Decode-side reuse: the destination holds the handle's first `skip` blocks already (its
    prefix cache); only the others are asked for and written, each to its own place (3 skips
    exactly the source's first run; 4 starts inside the second)."""
    full = torch.randn(LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)

    async def scenario():
        handle, servers = await _serve(full, 2)
        dst = _cache(HEADS)
        puller = KvPuller(PullPolicy(chunk_bytes=2 * BLOCK_SIZE * HEAD_DIM * 4, window=3), "ucx")
        try:
            report = await puller.pull(
                handle, DST_BLOCKS[skip:], KvDestination(dst, range(HEADS)), skip=skip
            )
        finally:
            await puller.close()
            for s in servers:
                s.close()
        return dst, report, handle

    dst, report, handle = asyncio.run(scenario())
    moved = DST_BLOCKS[skip:]
    assert torch.equal(dst[:, :, moved], full[:, :, SRC_BLOCKS[skip:]])
    assert not dst[:, :, [b for b in range(BLOCKS) if b not in moved]].any()
    assert report.nbytes == handle.total_bytes * (len(SRC_BLOCKS) - skip) // len(SRC_BLOCKS)
