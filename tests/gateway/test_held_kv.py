"""The gateway's one owner of KV held on a prefill instance (`HeldKv`): what it frees on exit, in
each case the handoff meets, against a real gRPC server that records what it was asked."""

from __future__ import annotations

import asyncio

import grpc

from services.common.gen.distserve.v1 import (
    common_pb2,
    kvtransfer_pb2,
    kvtransfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.gateway.held_kv import HeldKv


class _Recorder(kvtransfer_pb2_grpc.KvTransferServicer, prefill_pb2_grpc.PrefillServicer):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def Release(self, request, context):
        self.calls.append(("release", request.handle_id))
        return kvtransfer_pb2.ReleaseResponse(blocks_freed=1)

    async def Abandon(self, request, context):
        self.calls.append(("abandon", request.request_id))
        return prefill_pb2.AbandonResponse(freed=True)


async def _exit_calls(steps) -> list[tuple[str, str]]:
    """What a HeldKv asked of the prefill instance once `steps(held, stub, kv)` ran in it."""
    recorder = _Recorder()
    server = grpc.aio.server()
    kvtransfer_pb2_grpc.add_KvTransferServicer_to_server(recorder, server)
    prefill_pb2_grpc.add_PrefillServicer_to_server(recorder, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    await server.start()
    channels: dict[str, grpc.aio.Channel] = {}

    def channel(addr: str) -> grpc.aio.Channel:
        return channels.setdefault(addr, grpc.aio.insecure_channel(addr))

    kv = common_pb2.KvHandle(handle_id="h1", access_token="t", control_address=address)
    stub = prefill_pb2_grpc.PrefillStub(channel(address))
    try:
        try:
            async with HeldKv(channel, None) as held:
                steps(held, stub, kv)
        except RuntimeError:  # the try failed: HeldKv frees on that exit too
            pass
    finally:
        for ch in channels.values():
            await ch.close()
        await server.stop(None)
    return recorder.calls


def _run(steps) -> list[tuple[str, str]]:
    return asyncio.run(_exit_calls(steps))


def test_kv_a_decode_instance_took_is_not_released_here():
    def taken(held, stub, kv):
        held.prefilling(stub, "r1")
        held.prefilled(kv)
        held.taken()

    assert _run(taken) == []


def test_kv_nobody_took_is_released_on_exit_whatever_ended_the_try():
    def left_at_first_token(held, stub, kv):
        held.prefilling(stub, "r1")
        held.prefilled(kv)

    def decode_failed_after_it_answered(held, stub, kv):
        held.prefilling(stub, "r1")
        held.prefilled(kv)
        held.taken()
        held.doubted()

    def handle_then_prefill_failed(held, stub, kv):
        held.prefilling(stub, "r1")
        held.handle(kv)
        raise RuntimeError("the Prefill call failed after it sent its handle")

    for steps in (left_at_first_token, decode_failed_after_it_answered, handle_then_prefill_failed):
        assert _run(steps) == [("release", "h1")], steps.__name__


def test_a_prefill_call_ended_without_its_result_is_abandoned_unless_unreachable():
    def cancelled_before_its_result(held, stub, kv):
        held.prefilling(stub, "r1")
        raise RuntimeError("cancelled here: the call may have completed there")

    def unreachable(held, stub, kv):
        held.prefilling(stub, "r1")
        held.unreachable()
        raise RuntimeError("prefill instance unavailable")

    def ended_at_its_first_token(held, stub, kv):
        held.prefilling(stub, "r1")
        held.handle(kv)  # a layer-wise handle, then the result: nothing held (freed there)
        held.prefilled(None)

    assert _run(cancelled_before_its_result) == [("abandon", "r1")]
    assert _run(unreachable) == []
    assert _run(ended_at_its_first_token) == []
