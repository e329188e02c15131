"""KV pulled over real UCX into another engine's blocks decodes to the same tokens."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from dataclasses import replace

import crc32c
import pytest
import torch

from services.common.errors import NotFound, PermissionDenied
from services.common.kv_handle import KvHandle, RankSource
from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.kvtransfer import checksums, transports, ucx_loop, wire
from services.kvtransfer.chunk_server import ChunkServer
from services.kvtransfer.faults import corrupted
from services.kvtransfer.layout import KvDestination, PullChunk, requests_for, segments
from services.kvtransfer.leases import LeaseTable
from services.kvtransfer.puller import KvPuller, PullPolicy
from services.kvtransfer.source import ChunkSource
from services.kvtransfer.transports import GrpcTransport, UcxTransport

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
HEADS = range(2)  # the tiny model's KV heads


def handle_for(engine: LLMEngine, rid: str, port: int) -> KvHandle:
    seq = engine.sequence(rid)
    cache = engine.runner.cache
    mc = engine.model_config
    return KvHandle(
        handle_id="",
        source_instance="prefill-test",
        control_address="",
        ucx_host="127.0.0.1",
        ucx_port=port,
        num_tokens=seq.num_prompt_tokens,
        block_size=cache.block_size,
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype="float32",
        runs=tuple((f, n) for f, n in seq.block_table.runs),
        block_bytes=cache.block_bytes,
        lease_expiry_unix_ms=0,
        access_token="",
    )


def serve(cache: torch.Tensor, heads: range, runs) -> tuple[ChunkServer, KvHandle]:
    """A chunk server over `cache` (layers, K/V, blocks, block_size, heads, head_dim; float32)
    holding `heads`, and a handle of its blocks `runs` (from the running event loop)."""
    layers, _, _, block_size, num_heads, head_dim = cache.shape
    leases = LeaseTable(default_s=30, max_s=60)
    source = ChunkSource(leases, lambda layer, kv, f, n: cache[layer, kv, f : f + n], layers, heads)
    server = ChunkServer(source)
    template = KvHandle(
        handle_id="", source_instance="p", control_address="127.0.0.1:9",
        ucx_host="127.0.0.1", ucx_port=server.start(),
        num_tokens=sum(n for _, n in runs) * block_size, block_size=block_size,
        num_layers=layers, num_kv_heads=num_heads, head_dim=head_dim, dtype="float32",
        runs=tuple(runs), block_bytes=block_size * num_heads * head_dim * 4,
        lease_expiry_unix_ms=0, access_token="",
    )  # fmt: skip
    return server, leases.create("r", template)


def test_segments_split_where_either_side_breaks_and_at_the_chunk_size():
    assert segments([4, 5, 6, 9, 10], [0, 1, 2, 3, 4], 8) == [(0, 0, 3), (3, 3, 2)]
    assert segments([4, 5, 6, 7], [0, 1, 7, 8], 8) == [(0, 0, 2), (2, 7, 2)]
    assert segments([0, 1, 2, 3, 4], [5, 6, 7, 8, 9], 2) == [(0, 5, 2), (2, 7, 2), (4, 9, 1)]


def test_requests_take_up_to_32_chunks_of_one_source_in_layer_order():
    ucx, grpc_ = UcxTransport(), GrpcTransport(lambda address: None)
    rank0 = RankSource(rank=0, heads=range(0, 2), ucx_host="h", ucx_port=1)
    rank1 = RankSource(rank=1, heads=range(2, 4), ucx_host="h", ucx_port=2)
    chunks = [
        PullChunk(layer, kv, (i, i, 1), ucx, source, source.heads)
        for source in (rank0, rank1)
        for layer in range(5)
        for kv in (0, 1)
        for i in range(4)
    ]  # 40 chunks from each rank
    batches = requests_for(chunks)
    assert [len(b) for b in batches] == [wire.MAX_CHUNKS, wire.MAX_CHUNKS, 8, 8]
    for batch in batches:
        assert len({c.source for c in batch}) == 1
        assert [c.layer for c in batch] == sorted(c.layer for c in batch)
    assert [b[0].layer for b in batches] == [0, 0, 4, 4]  # requests in the order of layers
    assert sorted(id(c) for b in batches for c in b) == sorted(id(c) for c in chunks)
    # The gRPC fallback answers one chunk a call.
    one_each = requests_for(
        [PullChunk(0, kv, (0, 0, 1), grpc_, rank0, rank0.heads) for kv in (0, 1)]
    )
    assert [len(b) for b in one_each] == [1, 1]


def test_checksums_are_taken_as_layers_are_published_and_match_the_pullers():
    async def scenario():
        # (layers, K/V, blocks, block_size, heads, head_dim), the bench's kind of source
        cache = torch.randn((2, 2, 8, 4, 2, 3))
        leases = LeaseTable(default_s=30, max_s=60)
        source = ChunkSource(leases, lambda layer, kv, f, n: cache[layer, kv, f : f + n], 2, HEADS)
        template = KvHandle(
            handle_id="", source_instance="p", control_address="", ucx_host="", ucx_port=0,
            num_tokens=20, block_size=4, num_layers=2, num_kv_heads=2, head_dim=3,
            dtype="float32", runs=((2, 3), (6, 2)), block_bytes=4 * 2 * 3 * 4,
            lease_expiry_unix_ms=0, access_token="", layerwise=True,
        )  # fmt: skip
        handle = leases.create("r", template)
        lease = leases.get(handle.handle_id, handle.access_token)
        assert lease.digests == {}  # nothing computed yet
        lease.publish(1)
        assert sorted(lease.digests) == [0]  # taken as each layer is published, not later
        lease.publish(2)
        assert sorted(lease.digests) == [0, 1]

        def request(num_heads: int) -> wire.ChunkRequest:
            return wire.ChunkRequest(
                handle_id=handle.handle_id,
                access_token=handle.access_token,
                num_heads=num_heads,
                chunks=[wire.ChunkRange(layer=1, kv=1, first_block=1, num_blocks=2)],
            )

        whole = source.open(request(0))  # blocks 3, 4 of layer 1's V: all heads, in place
        part = source.open(request(1))  # head 0 only: a copy, hashed as it is sent
        for chunk in (*whole, *part):
            await source.ready(chunk)
            await source.seal(chunk)
        # Combined from the blocks' CRCs or of the copy's bytes: the CRC-32C of what is sent,
        # which is what the puller computes over what it received.
        sent = cache[1, 1, 3:5].numpy().tobytes()
        assert whole[0].data.tobytes() == sent
        assert source.status(whole).crc32c == [crc32c.crc32c(sent)]
        copy = cache[1, 1, 3:5, :, 0:1].contiguous().numpy().tobytes()
        assert source.status(part).crc32c == [crc32c.crc32c(copy)]
        assert checksums.checksum_of(corrupted(whole[0].data)) != crc32c.crc32c(sent)

    asyncio.run(scenario())


def test_pull_over_ucx_then_decode_equals_one_engine(tiny_model):
    prompt = list(range(3, 70))
    expected = LLMEngine(tiny_model, EngineConfig(num_blocks=64)).generate([prompt], PARAMS)[0]

    async def scenario():
        prefill = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=8), detokenize=False)
        decode = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=8), detokenize=False)
        decode.pool.allocate(5)  # destination blocks differ from the source's
        prefill.add_request(prompt, PARAMS, request_id="r")
        [first] = prefill.prefill_step(hold=True)
        leases = LeaseTable(default_s=30, max_s=60)
        server = ChunkServer(ChunkSource(leases, prefill.runner.cache.region, 2, HEADS))
        port = server.start()
        handle = leases.create("r", handle_for(prefill, "r", port))
        # One block a chunk: 2 layers x K/V x 9 blocks = 36 chunks, in two requests.
        puller = KvPuller(PullPolicy(chunk_bytes=prefill.runner.cache.block_bytes, window=3))
        try:
            decode.add_prefilled(prompt, first.new_token_ids[0], PARAMS, "r")
            [seq] = decode.admit_pulls()
            # A wrong token and an unknown handle are refused, and nothing is written.
            with pytest.raises(PermissionDenied, match="wrong access token"):
                await puller.pull(
                    replace(handle, access_token="guess"),
                    seq.block_table.blocks,
                    KvDestination(decode.runner.cache.data, HEADS),
                )
            with pytest.raises(NotFound):
                await puller.pull(
                    replace(handle, handle_id="nope"),
                    seq.block_table.blocks,
                    KvDestination(decode.runner.cache.data, HEADS),
                )
            report = await puller.pull(
                handle, seq.block_table.blocks, KvDestination(decode.runner.cache.data, HEADS)
            )
            assert report.nbytes == handle.total_bytes
            assert (report.transport, report.retries) == ("ucx", 0)
            assert report.chunks == server.source.chunks_served == 2 * 2 * 9
            assert server.requests_served == 2  # 32 chunks, then 4
        finally:
            await puller.close()
            server.close()
        decode.start_decoding("r")
        tokens = list(first.new_token_ids)
        while decode.has_unfinished():
            tokens += [t for o in decode.step() for t in o.new_token_ids]
        return tokens

    assert asyncio.run(scenario()) == expected.token_ids


def test_an_attempt_whose_receives_all_completed_keeps_the_shared_endpoint(monkeypatch):
    """However late the event loop gets to look (a drain wait of 0 s stands for a loop busy
    longer than DRAIN_S), completed receives are judged completed: the endpoint every other
    pull shares is not dropped and no pull reconnects."""
    monkeypatch.setattr(transports, "DRAIN_S", 0.0)

    async def scenario():
        cache = torch.randn((2, 2, 8, 4, 2, 3))  # (layers, K/V, blocks, block_size, heads, dim)
        server, handle = serve(cache, HEADS, ((2, 4),))
        dst = torch.zeros_like(cache)
        puller = KvPuller(PullPolicy(chunk_bytes=handle.block_bytes))  # a chunk a block
        try:
            for _ in range(3):
                report = await puller.pull(handle, [0, 1, 2, 3], KvDestination(dst, HEADS))
                assert report.retries == 0
            assert puller.reconnects == 0
            assert len(puller._ucx._endpoints) == puller._ucx.lanes  # one per lane
        finally:
            await puller.close()
            server.close()
        assert torch.equal(dst[:, :, 0:4], cache[:, :, 2:6])

    asyncio.run(scenario())


@pytest.mark.parametrize("lanes", [1, 2])
def test_each_chunk_is_hashed_by_the_lane_that_copied_it(monkeypatch, lanes):
    """Chunks of 16 KiB blocks (the `small` preset's size) are checked with one CRC-32C call
    each, as a whole, by the thread that received them: the event loop with one lane; with two,
    each lane's own thread (the lanes take turns, chunk by chunk; the loop copies none). The KV
    arrives whole either way."""
    hashed_on = []

    def checksum_of(data):
        if data.nbytes == 2**20:  # a chunk (the source hashes its 16 KiB blocks too)
            hashed_on.append(threading.current_thread().name)
        return crc32c.crc32c(data)

    monkeypatch.setattr(transports, "checksum_of", checksum_of)  # the puller's hashing
    head_dim = 4096
    blocks = (2 * 2**20) // (head_dim * 4)

    async def scenario():
        cache = torch.randn((1, 2, blocks, 1, 1, head_dim))  # a chunk = one layer's K or V
        server, handle = serve(cache, range(1), ((0, blocks),))
        dst = torch.zeros_like(cache)
        puller = KvPuller(PullPolicy(chunk_bytes=2**20, lanes=lanes))
        try:
            report = await puller.pull(handle, list(range(blocks)), KvDestination(dst, range(1)))
            endpoints = len(puller._ucx._endpoints)
        finally:
            await puller.close()
            server.close()
        assert (report.chunks, report.retries, endpoints) == (4, 0, lanes)
        assert server.requests_served == lanes  # a request a lane
        assert torch.equal(dst, cache)

    asyncio.run(scenario())
    expected = {"MainThread": 4} if lanes == 1 else {"ucx-lane-1": 2, "ucx-lane-2": 2}
    assert Counter(hashed_on) == expected


def test_the_lanes_share_the_window(monkeypatch):
    """With W chunks in flight per pull, each of two lanes has W/2: one window for both let the
    first lane's request take every place (its chunks ask first), and the other lane idled
    until it freed some."""
    in_flight, most, posted = Counter(), Counter(), Counter()  # data receives, by lane
    recv = ucx_loop.UcxEndpoint.recv

    def recording(self, buffer, tag=0, then=None):
        future = recv(self, buffer, tag, then)
        if tag % 2:  # data (a status frame goes on an even tag)
            lane = self.worker.number
            in_flight[lane] += 1
            posted[lane] += 1
            most[lane] = max(most[lane], in_flight[lane])

            def done(_) -> None:
                in_flight[lane] -= 1

            future.add_done_callback(done)
        return future

    monkeypatch.setattr(ucx_loop.UcxEndpoint, "recv", recording)

    async def scenario():
        cache = torch.randn((4, 2, 8, 4, 2, 3))  # (layers, K/V, blocks, block_size, heads, dim)
        server, handle = serve(cache, HEADS, ((0, 8),))
        dst = torch.zeros_like(cache)
        policy = PullPolicy(chunk_bytes=2 * handle.block_bytes, window=4, lanes=2)
        puller = KvPuller(policy)
        try:
            report = await puller.pull(handle, list(range(8)), KvDestination(dst, HEADS))
        finally:
            await puller.close()
            server.close()
        assert (report.chunks, report.retries) == (4 * 2 * 4, 0)
        assert torch.equal(dst, cache)

    asyncio.run(scenario())
    assert posted == {1: 16, 2: 16} and most == {1: 2, 2: 2}
