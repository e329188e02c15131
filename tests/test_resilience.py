"""Losing an instance mid-request, on a real mesh (tiny model): a decode instance killed
mid-stream, and graceful drain on SIGTERM (in-flight work finishes within the drain timeout, or
moves to another instance when it runs out). The client's greedy stream equals the in-process
engine's, with no duplicate and no missing token, and nothing is left held."""

from __future__ import annotations

import signal
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.conftest import start_mesh, stop_now
from tests.test_mesh import addresses, expected, stats, wait_until

PROMPT = "The decode phase adds one token at a time"
MAX_TOKENS = 400  # long enough to be cut mid-stream (the tiny model decodes ~2-5 ms a token)
RELEASE_IN_FLIGHT = Path(__file__).with_name("decode_release_in_flight.py")


def _process(mesh, name: str):
    return next(p for p in mesh.workers if p.name == name)


def _serving_decode(mesh) -> str:
    """The name of the decode instance running a sequence now."""
    for p in mesh.workers:
        alive = p.name.startswith("decode") and p.popen.poll() is None
        if alive and stats(p.ready["address"], "decode").load.running_seqs:
            return p.name
    raise AssertionError("no decode instance is running the request")


def _stream_with_fault(mesh, fault, after_tokens: int = 8) -> list[int]:
    """Stream PROMPT greedily; once `after_tokens` arrived, `fault(mesh)`; all the tokens."""
    params = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        ids: list[int] = []
        faulted = False
        for r in stub.Generate(gateway_pb2.GenerateRequest(text=PROMPT, sampling=params)):
            ids += r.token_ids
            if not faulted and len(ids) >= after_tokens:
                fault(mesh)
                faulted = True
        assert faulted and r.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert r.usage.completion_tokens == len(ids)
    return ids


def migrations(mesh) -> float:
    host = next(p for p in mesh.processes if p.name == "gateway").ready["metrics_address"]
    with urllib.request.urlopen(f"http://{host}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("distserve_migrations_total{")
    )


@pytest.fixture(scope="module")
def reference(tiny_model) -> list[int]:
    return expected(tiny_model, [PROMPT], max_tokens=MAX_TOKENS)[0][0]


@pytest.fixture
def mesh_1p2d(tiny_model):
    # Decode instances drain for 50 ms only (a 400-token stream takes far longer anywhere): a
    # SIGTERM hands long streams off.
    mesh = start_mesh(tiny_model, prefill=1, decode=2, decode_args=("--drain-timeout-s", "0.05"))
    yield mesh
    stop_now(mesh)


def test_a_decode_instance_killed_mid_stream_is_invisible_to_the_client(mesh_1p2d, reference):
    mesh = mesh_1p2d
    killed = []

    def kill(m) -> None:
        killed.append(_serving_decode(m))
        _process(m, killed[0]).popen.send_signal(signal.SIGKILL)

    before = migrations(mesh)
    assert _stream_with_fault(mesh, kill) == reference
    assert migrations(mesh) == before + 1
    assert _process(mesh, killed[0]).popen.wait(timeout=5) == -signal.SIGKILL
    # The prefill instance holds nothing: the moved request's KV was pulled and released.
    prefill = addresses(mesh, "prefill")[0]
    wait_until(lambda: stats(prefill, "prefill").load.held_kv_handles == 0, what="KV released")


def test_decode_killed_before_its_release_landed_frees_prefill_kv_long_before_the_lease(
    tiny_model, reference
):
    """A decode instance killed after it told the gateway it has the KV but before its release
    reached the prefill instance (a window of a few ms, held open here: decode-0's releases
    stay in flight, tests/decode_release_in_flight.py): the gateway, losing the instance,
    releases the KV itself. The source's lease (30 s) is the safety net, not the way out."""
    lease_s = 30.0
    mesh = start_mesh(
        tiny_model,
        prefill=1,
        decode=2,
        prefill_args=("--lease-s", str(lease_s)),
        # More free KV: the least-loaded instance, so the request starts there.
        per_worker_args={"decode-0": ("--kv-cache-gib", "0.03125")},
        command_prefix={"decode-0": (sys.executable, str(RELEASE_IN_FLIGHT))},
    )
    try:
        killed = []

        def kill(m) -> None:
            killed.append(_serving_decode(m))
            _process(m, "decode-0").popen.send_signal(signal.SIGKILL)
            killed.append(time.monotonic())

        assert _stream_with_fault(mesh, kill) == reference  # moved to decode-1, exactly
        assert killed[0] == "decode-0"
        prefill = addresses(mesh, "prefill")[0]
        wait_until(
            lambda: stats(prefill, "prefill").load.held_kv_handles == 0,
            timeout=lease_s / 6,
            what="the KV of the killed instance's request to be released",
        )
        assert time.monotonic() - killed[1] < lease_s / 3
        s = stats(prefill, "prefill")
        assert s.leases_expired == 0 and s.blocks_reclaimed == 0
        assert s.load.free_kv_blocks == s.load.total_kv_blocks
    finally:
        stop_now(mesh)


def test_a_decode_instance_that_drains_out_of_time_hands_its_streams_off(mesh_1p2d, reference):
    mesh = mesh_1p2d
    drained = []

    def terminate(m) -> None:
        drained.append(_serving_decode(m))
        _process(m, drained[0]).popen.send_signal(signal.SIGTERM)

    before = migrations(mesh)
    assert _stream_with_fault(mesh, terminate) == reference
    assert migrations(mesh) == before + 1
    # It exits by itself, cleanly, once the drain timed out and its requests moved.
    assert _process(mesh, drained[0]).popen.wait(timeout=15) == 0
    other = next(p for p in mesh.workers if p.name.startswith("decode") and p.name != drained[0])
    load = stats(other.ready["address"], "decode").load
    assert load.running_seqs == 0 and load.free_kv_blocks == load.total_kv_blocks


def test_sigterm_lets_in_flight_work_finish_then_the_instance_leaves(tiny_model, reference):
    mesh = start_mesh(tiny_model, prefill=1, decode=1, drain_timeout_s=60.0)
    try:
        started = []

        def terminate(m) -> None:
            started.append(time.monotonic())
            _process(m, "decode-0").popen.send_signal(signal.SIGTERM)

        before = migrations(mesh)
        # The stream ends on the instance it started on: the drain waits for it.
        assert _stream_with_fault(mesh, terminate) == reference
        assert migrations(mesh) == before
        decode = _process(mesh, "decode-0")
        assert decode.popen.wait(timeout=15) == 0
        # Deregistered: the gateway has no decode instance, and says so.
        with pytest.raises(grpc.RpcError) as err:
            params = common_pb2.SamplingParams(max_tokens=2)
            with grpc.insecure_channel(mesh.gateway_address) as channel:
                list(
                    gateway_pb2_grpc.GatewayStub(channel).Generate(
                        gateway_pb2.GenerateRequest(text="hi", sampling=params), timeout=10
                    )
                )
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no complete serving path" in err.value.details()
        # An idle prefill instance leaves at once.
        prefill = _process(mesh, "prefill-0")
        prefill.popen.send_signal(signal.SIGTERM)
        assert prefill.popen.wait(timeout=10) == 0
    finally:
        mesh.stop()
