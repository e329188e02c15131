"""Faults on the KV data plane, injected in the prefill instance's chunk server: every case ends
with the fault-free tokens or a clear error, and no KV block held on either side."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.kvtransfer.faults import Fault, strike
from tests.test_mesh import PROMPTS, addresses, expected, generate, kv_all_free, stats, wait_until
from tests.test_observability import scrape, value

PROMPT = PROMPTS[2]  # long enough for several chunks per layer with 4-block chunks
DECODE = ("--chunk-timeout-s", "1", "--chunk-attempts", "4", "--chunk-kb", "4")


@pytest.mark.parametrize(
    ("kind", "sent", "calls"),
    [("drop", None, ["drop"]), ("close", None, ["close"]), ("delay", "same", []),
     ("corrupt", "one byte flipped", [])],
)  # fmt: skip
def test_what_each_fault_sends_instead_of_the_chunk(kind, sent, calls):
    """One decision for both transports: they say only how to close and how to drop."""
    data = np.arange(16, dtype=np.uint8)
    called = []

    async def close() -> None:
        called.append("close")

    async def drop() -> None:
        called.append("drop")

    fault = Fault(kind, 1, seconds=0.01)
    out = asyncio.run(strike(fault, data, close=close, drop=drop))
    assert called == calls
    if sent is None:
        assert out is None
    elif sent == "same":
        assert out is data
    else:
        assert np.count_nonzero(out != data) == 1 and data[8] == 8  # a copy: the cache untouched


@pytest.fixture(scope="module")
def fault_free(tiny_model):
    return expected(tiny_model, [PROMPT])[0][0]


@pytest.mark.parametrize(
    ("transport", "fault", "counter"),
    [
        ("ucx", "drop@2", "chunks_retried"),
        ("ucx", "delay@2:2.5", "chunks_retried"),
        ("ucx", "corrupt@2", "checksum_failures"),
        ("ucx", "close@2", "reconnects"),
        ("grpc", "drop@2", "chunks_retried"),
        ("grpc", "corrupt@2", "checksum_failures"),
    ],
)
def test_a_faulty_chunk_is_fetched_again_and_the_tokens_are_unchanged(
    mesh_factory, fault_free, fault, counter, transport
):
    mesh = mesh_factory(
        prefill=1,
        decode=1,
        prefill_args=("--kv-faults", fault),
        decode_args=(*DECODE, "--kv-transport", transport),
    )
    ids, _, last = asyncio.run(asyncio.wait_for(generate(mesh.gateway_address, PROMPT), 60))
    assert ids == fault_free
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    d = stats(addresses(mesh, "decode")[0], "decode")
    assert d.chunks_retried >= 1 and d.pulls_failed == 0
    assert getattr(d, counter) >= 1
    # ... and the decode instance's Prometheus endpoint says the same.
    [decode] = [w for w in mesh.workers if w.name.startswith("decode")]
    metrics = scrape(decode.ready["metrics_address"])
    assert value(metrics, f"distserve_kv_{counter}_total") == getattr(d, counter)
    assert value(metrics, "distserve_kv_pulls_failed_total") == 0
    wait_until(lambda: kv_all_free(mesh), what="KV to be freed on both sides")


def test_a_source_killed_mid_pull_is_replaced_by_prefilling_again(mesh_factory, fault_free):
    mesh = mesh_factory(
        prefill=2,
        decode=1,
        decode_args=DECODE,
        per_worker_args={"prefill-0": ("--kv-faults", "exit@2")},
    )
    ids, _, _ = asyncio.run(asyncio.wait_for(generate(mesh.gateway_address, PROMPT), 60))
    assert ids == fault_free
    dead = next(p for p in mesh.workers if p.name == "prefill-0")
    assert dead.popen.wait(timeout=10) == 17  # it really died mid-pull
    d = stats(addresses(mesh, "decode")[0], "decode")
    assert d.pulls_failed == 1 and d.pulls_total == 1
    assert stats(addresses(mesh, "prefill")[1], "prefill").requests_total == 1
    mesh.processes.remove(dead)
    wait_until(lambda: kv_all_free(mesh), what="KV to be freed on the live instances")


def test_without_another_source_the_client_gets_a_clear_error(mesh_factory):
    mesh = mesh_factory(
        prefill=1, decode=1, decode_args=DECODE, prefill_args=("--kv-faults", "exit@2")
    )
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        params = common_pb2.SamplingParams(max_tokens=24, ignore_eos=True)
        with pytest.raises(grpc.RpcError) as err:
            list(
                stub.Generate(gateway_pb2.GenerateRequest(text=PROMPT, sampling=params), timeout=60)
            )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "KV pull" in err.value.details() or "prefill" in err.value.details()
    mesh.processes[:] = [p for p in mesh.processes if p.popen.poll() is None]
    d = stats(addresses(mesh, "decode")[0], "decode")
    assert d.load.free_kv_blocks == d.load.total_kv_blocks and d.load.running_seqs == 0


def test_cancel_during_a_pull_frees_both_sides(mesh_factory):
    mesh = mesh_factory(
        prefill=1,
        decode=1,
        prefill_args=("--kv-faults", "delay@1:4"),
        # Far longer than the delay: the pull waits on chunk 1, no retry, when the client
        # cancels; the gateway releases the KV, and the source refuses the chunk it was holding
        # back at once, so the decode instance frees the pull's blocks long before its chunk
        # timeout.
        decode_args=("--chunk-timeout-s", "30"),
    )

    async def cancel_while_pulling():
        async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            params = common_pb2.SamplingParams(max_tokens=24, ignore_eos=True)
            call = stub.Generate(gateway_pb2.GenerateRequest(text=PROMPT, sampling=params))
            async for _ in call:  # the first token: prefill is done, the pull hangs on chunk 1
                await asyncio.sleep(1.0)
                d = stats(addresses(mesh, "decode")[0], "decode")
                assert d.load.pending_pulls == 1
                call.cancel()
                break

    asyncio.run(cancel_while_pulling())
    wait_until(lambda: kv_all_free(mesh), timeout=10, what="KV to be freed after the cancel")
    assert stats(addresses(mesh, "decode")[0], "decode").requests_aborted == 1


def test_the_lease_is_renewed_while_a_slow_pull_runs(mesh_factory, fault_free):
    mesh = mesh_factory(
        prefill=1,
        decode=1,
        prefill_args=("--lease-s", "1", "--kv-faults", "delay@2:2"),
        decode_args=("--chunk-timeout-s", "5"),
    )
    ids, _, _ = asyncio.run(asyncio.wait_for(generate(mesh.gateway_address, PROMPT), 60))
    assert ids == fault_free  # the pull outlived the 1 s lease: renewals kept it
    assert stats(addresses(mesh, "decode")[0], "decode").lease_renewals >= 1
    p = stats(addresses(mesh, "prefill")[0], "prefill")
    assert p.leases_expired == 0
    wait_until(lambda: kv_all_free(mesh), what="KV to be freed on both sides")
