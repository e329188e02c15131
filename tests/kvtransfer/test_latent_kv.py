"""A latent KV (multi-head latent attention: one plane per layer, one head that every rank holds
whole) moves over real UCX like any other: each destination rank, of a tp=1 or a tp=2
instance, gets the whole latent, bit for bit, from one source rank."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.common.kv_handle import KvHandle, RankSource
from services.kvtransfer.chunk_server import ChunkServer
from services.kvtransfer.layout import KvDestination
from services.kvtransfer.leases import LeaseTable
from services.kvtransfer.puller import KvPuller, PullPolicy
from services.kvtransfer.source import ChunkSource

LAYERS, BLOCKS, BLOCK_SIZE, LATENT = 3, 8, 4, 40  # LATENT: kv_lora_rank + qk_rope_head_dim
SRC_BLOCKS = [1, 2, 3, 6, 7]
DST_BLOCKS = [0, 4, 5, 6, 2]


def _cache() -> torch.Tensor:
    return torch.zeros(LAYERS, 1, BLOCKS, BLOCK_SIZE, 1, LATENT)  # one plane, one head


async def _serve(full: torch.Tensor, tp: int) -> tuple[KvHandle, list[ChunkServer]]:
    """A source of `tp` ranks, each holding the whole latent (its own copy, as each rank of a
    tensor-parallel prefill computes it)."""
    servers, tables = [], []
    for _ in range(tp):
        copy = full.clone()
        table = LeaseTable(default_s=30, max_s=60)
        source = ChunkSource(
            table,
            lambda layer, kv, first, n, s=copy: s[layer, kv, first : first + n],
            LAYERS,
            range(1),
            planes=1,
        )
        servers.append(ChunkServer(source))
        servers[-1].start()
        tables.append(table)
    ranks = tuple(RankSource(r, "127.0.0.1", s.port, range(1)) for r, s in enumerate(servers))
    template = KvHandle(
        handle_id="",
        source_instance="prefill-mla",
        control_address="",
        ucx_host="127.0.0.1",
        ucx_port=servers[0].port,
        num_tokens=len(SRC_BLOCKS) * BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        num_layers=LAYERS,
        num_kv_heads=1,
        head_dim=LATENT,
        dtype="float32",
        runs=((1, 3), (6, 2)),
        block_bytes=BLOCK_SIZE * LATENT * 4,
        lease_expiry_unix_ms=0,
        access_token="",
        rank_sources=ranks if tp > 1 else (),
        kv_planes=1,
    )
    handle = tables[0].create("r", template)
    for table in tables[1:]:
        table.adopt("r", handle, LAYERS)
    return handle, servers


@pytest.mark.parametrize("source_tp", [1, 2])
@pytest.mark.parametrize("dest_tp", [1, 2])
def test_every_destination_rank_gets_the_whole_latent(source_tp, dest_tp):
    full = torch.randn(LAYERS, 1, BLOCKS, BLOCK_SIZE, 1, LATENT)

    async def scenario():
        handle, servers = await _serve(full, source_tp)
        # The handle as it crosses the wire: its planes travel with it.
        handle = KvHandle.from_pb(handle.to_pb())
        puller = KvPuller(PullPolicy(chunk_bytes=2 * BLOCK_SIZE * LATENT * 4, window=3), "ucx")
        dests, reports = [_cache() for _ in range(dest_tp)], []
        try:
            for dst in dests:  # each rank of the destination pulls the latent it holds: all
                reports.append(await puller.pull(handle, DST_BLOCKS, KvDestination(dst, range(1))))
        finally:
            await puller.close()
            for s in servers:
                s.close()
        return handle, dests, reports, servers

    handle, dests, reports, servers = asyncio.run(scenario())
    assert handle.kv_planes == 1
    assert handle.total_bytes == LAYERS * len(SRC_BLOCKS) * BLOCK_SIZE * LATENT * 4
    untouched = [b for b in range(BLOCKS) if b not in DST_BLOCKS]
    for dst, report in zip(dests, reports, strict=True):
        assert torch.equal(dst[:, :, DST_BLOCKS], full[:, :, SRC_BLOCKS])
        assert not dst[:, :, untouched].any()
        assert report.nbytes == handle.total_bytes  # the latent once, not once per source rank
    # Every head from the first rank holding it: the other source ranks are not asked.
    assert [bool(s.source.chunks_served) for s in servers] == [True] + [False] * (source_tp - 1)
