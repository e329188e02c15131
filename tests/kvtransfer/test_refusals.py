"""A source's refusal travels as a reason (KvChunkStatus.Refusal) over both transports, the
message in words beside it, and the puller raises the error the reason names, whatever the
words say."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from services.common.errors import (
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from services.common.kv_handle import RankSource
from services.kvtransfer import wire
from services.kvtransfer.refusals import error_of, refused
from services.kvtransfer.servicer import KvTransferServicer
from services.kvtransfer.transports import UcxTransport, Window
from tests.kvtransfer.test_ucx_pull import serve

Status = wire.ChunkStatus


@pytest.mark.parametrize(
    ("error", "reason", "raised"),
    [
        (NotFound, Status.REFUSAL_NOT_FOUND, NotFound),
        (PermissionDenied, Status.REFUSAL_PERMISSION_DENIED, PermissionDenied),
        (InvalidRequest, Status.REFUSAL_INVALID_REQUEST, InvalidRequest),
        # a layer not computed in time: retried from a new prefill, not the client's fault
        (DeadlineExceeded, Status.REFUSAL_LAYER_NOT_COMPUTED, Unavailable),
    ],
)
def test_a_refusal_is_sent_as_its_reason_and_raised_as_the_error_it_names(error, reason, raised):
    status = wire.decode(wire.encode(refused(error("why"))), Status)  # a UCX status frame
    assert (status.ok, status.refusal, status.error) == (False, reason, "why")
    back = error_of(status)
    assert type(back) is raised and str(back) == "why"


def test_the_words_decide_nothing():
    status = Status(ok=False, error="wrong access token", refusal=Status.REFUSAL_NOT_FOUND)
    assert type(error_of(status)) is NotFound


def test_both_transports_carry_the_reason():
    async def scenario():
        cache = torch.zeros((2, 2, 4, 4, 2, 3))  # (layers, K/V, blocks, block_size, heads, dim)
        server, handle = serve(cache, range(2), [(0, 2)])
        servicer = KvTransferServicer(server.source.leases, free=None, source=server.source)
        source = RankSource(0, "127.0.0.1", server.port, range(2))
        ucx = UcxTransport()
        asked = {
            Status.REFUSAL_PERMISSION_DENIED: dict(access_token="guess"),
            Status.REFUSAL_NOT_FOUND: dict(handle_id="nope"),
            Status.REFUSAL_INVALID_REQUEST: dict(layer=9),
        }
        try:
            for reason, wrong in asked.items():
                fields = dict(handle_id=handle.handle_id, access_token=handle.access_token)
                fields.update(layer=0, kv=0, first_block=0, num_blocks=1)
                fields.update(wrong)
                over_grpc = await servicer.FetchChunk(wire.ChunkRequest(**fields), None)
                buffer = np.empty(handle.block_bytes, dtype=np.uint8)
                over_ucx = await ucx.fetch(
                    handle, source, wire.ChunkRequest(**fields), [buffer], Window(1), 5.0
                )
                for status in (over_grpc.status, over_ucx.status):
                    assert (status.ok, status.refusal) == (False, reason), status
        finally:
            await ucx.close()
            server.close()

    asyncio.run(scenario())
