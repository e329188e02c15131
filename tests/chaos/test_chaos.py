"""Chaos: instances die and drain while the mesh serves a steady load (tiny model, real
processes). Every accepted request must end with its exact greedy tokens or a clear error,
nothing may hang, and the survivors hold no KV afterwards, with no lease left to lapse.

The mesh has two prefill and two decode instances; the load is open-loop, several requests in
flight at once. At fixed points of the run: a decode instance is killed (SIGKILL: its streams
move), a prefill instance is killed (its queued prompts are prefilled elsewhere, KV being pulled
from it is prefilled again), and, on a second mesh, instances are drained (SIGTERM) under load.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.conftest import start_mesh
from tests.test_mesh import expected, stats, wait_until
from tests.test_resilience import migrations

PROMPTS = [
    "Hello",
    "The decode phase adds one token at a time",
    "A longer prompt: " + "prefill reads the whole prompt at once and writes the cache; " * 6,
    "東京 café 🙂",
    "Short",
    "Goodput is requests per second that meet both SLOs",
]
MAX_TOKENS = 48
REQUESTS = 36
INTERVAL_S = 0.08  # open loop: one request every INTERVAL_S
RESPONSE_BOUND_S = 90.0  # a request that takes longer hangs
LEASE_S = 6.0  # short leases: KV leaked by a request would lapse (and be counted) in the test


@pytest.fixture(scope="module")
def references(tiny_model) -> dict[str, list[int]]:
    outs = expected(tiny_model, PROMPTS, max_tokens=MAX_TOKENS)
    return {p: ids for p, (ids, _) in zip(PROMPTS, outs, strict=True)}


def _mesh(tiny_model, **kwargs):
    return start_mesh(
        tiny_model,
        prefill=2,
        decode=2,
        prefill_args=("--lease-s", str(LEASE_S)),
        # A dead peer is given up on fast: short chunk tries.
        decode_args=("--chunk-timeout-s", "1", "--chunk-attempts", "2"),
        **kwargs,
    )


async def _one(stub, prompt: str, delay: float) -> tuple[str, object]:
    await asyncio.sleep(delay)
    params = common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    ids: list[int] = []
    try:
        async for r in stub.Generate(
            gateway_pb2.GenerateRequest(text=prompt, sampling=params), timeout=RESPONSE_BOUND_S
        ):
            ids += r.token_ids
        return prompt, ids
    except grpc.aio.AioRpcError as e:
        return prompt, e


async def _load_with_faults(mesh, faults: list[tuple[float, str, signal.Signals]]):
    """REQUESTS requests, open loop, while each (at_s, process name, signal) fault fires."""
    by_name = {p.name: p for p in mesh.workers}

    async def fault(at_s: float, name: str, sig: signal.Signals) -> None:
        """At `at_s`, once the instance has work in flight, signal it."""
        await asyncio.sleep(at_s)
        address, role = by_name[name].ready["address"], name.split("-")[0]
        deadline = time.monotonic() + 20
        while not _busy((await asyncio.to_thread(stats, address, role)).load):
            assert time.monotonic() < deadline, f"{name} never had work in flight"
            await asyncio.sleep(0.005)
        by_name[name].popen.send_signal(sig)

    async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        faults_done = asyncio.gather(*(fault(*f) for f in faults))
        results = await asyncio.gather(
            *(_one(stub, PROMPTS[i % len(PROMPTS)], i * INTERVAL_S) for i in range(REQUESTS))
        )
        await faults_done
    return results


def _busy(load) -> bool:
    return bool(load.running_seqs or load.queued_prompt_tokens or load.held_kv_handles)


def _check(results, references) -> None:
    failed = [(p, r) for p, r in results if isinstance(r, BaseException)]
    assert not failed, [(p[:20], r.code().name, r.details()) for p, r in failed]
    for prompt, ids in results:
        assert ids == references[prompt], prompt


def _survivors_hold_nothing(mesh, names: list[str]) -> None:
    by_name = {p.name: p for p in mesh.workers}

    def free() -> bool:
        for name in names:
            role = "prefill" if name.startswith("prefill") else "decode"
            load = stats(by_name[name].ready["address"], role).load
            if load.free_kv_blocks != load.total_kv_blocks or load.held_kv_handles:
                return False
        return True

    wait_until(free, timeout=10, what="the survivors' KV to be free")
    for name in names:
        if name.startswith("prefill"):
            lapsed = stats(by_name[name].ready["address"], "prefill").leases_expired
            assert lapsed == 0, f"{name}: {lapsed} KV handles were held until their lease lapsed"


def test_killed_instances_under_load_lose_no_request(tiny_model, references):
    mesh = _mesh(tiny_model)
    try:
        start = time.monotonic()
        results = asyncio.run(
            _load_with_faults(
                mesh, [(0.6, "decode-1", signal.SIGKILL), (1.4, "prefill-1", signal.SIGKILL)]
            )
        )
        assert time.monotonic() - start < RESPONSE_BOUND_S
        _check(results, references)
        assert migrations(mesh) >= 1  # the faults hit requests in flight
        by_name = {p.name: p for p in mesh.workers}
        assert by_name["decode-1"].popen.poll() == -signal.SIGKILL
        assert by_name["prefill-1"].popen.poll() == -signal.SIGKILL
        time.sleep(LEASE_S + 1)  # a handle nobody released would lapse by now
        _survivors_hold_nothing(mesh, ["prefill-0", "decode-0"])
    finally:
        mesh.stop()


def test_instances_drained_under_load_lose_no_request(tiny_model, references):
    # Drains about as long as a request: in-flight work is finished or handed off.
    mesh = _mesh(tiny_model, drain_timeout_s=0.1)
    try:
        results = asyncio.run(
            _load_with_faults(
                mesh, [(0.6, "decode-1", signal.SIGTERM), (1.4, "prefill-1", signal.SIGTERM)]
            )
        )
        _check(results, references)  # finished within the drain, or moved: either way whole
        by_name = {p.name: p for p in mesh.workers}
        assert by_name["decode-1"].popen.wait(timeout=15) == 0
        assert by_name["prefill-1"].popen.wait(timeout=15) == 0
        time.sleep(LEASE_S + 1)
        _survivors_hold_nothing(mesh, ["prefill-0", "decode-0"])
    finally:
        mesh.stop()
