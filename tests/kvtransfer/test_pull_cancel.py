"""A pull that is given up (cancelled, or failed elsewhere) starts nothing more: the chunk in
flight settles, and is not fetched again."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.kvtransfer.layout import KvDestination
from services.kvtransfer.puller import KvPuller, PullPolicy
from tests.kvtransfer.test_head_split import (
    BLOCK_SIZE,
    BLOCKS,
    DST_BLOCKS,
    HEAD_DIM,
    HEADS,
    LAYERS,
    _serve,
)


def test_a_cancelled_pull_does_not_fetch_its_late_chunk_again():
    """The source answers the first chunk 2 s late, past the puller's 0.3 s chunk timeout; the
    pull is cancelled while that chunk is in flight: the attempt times out and is not made
    again (the cancel waits for one attempt at most, not for every retry)."""
    full = torch.randn(LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)

    async def scenario():
        handle, servers = await _serve(full, 1, faults="delay@1:2")
        puller = KvPuller(PullPolicy(chunk_timeout_s=0.3, window=1, backoff_s=0.01), "ucx")
        dst = KvDestination(
            torch.zeros(LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM), range(HEADS)
        )
        pull = asyncio.ensure_future(puller.pull(handle, DST_BLOCKS, dst))
        try:
            await asyncio.sleep(0.1)
            pull.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pull
            return puller.chunks_retried
        finally:
            await puller.close()
            for s in servers:
                s.close()

    assert asyncio.run(scenario()) == 0
