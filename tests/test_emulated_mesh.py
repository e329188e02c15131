"""The emulated mesh end to end: real processes, sockets and UCX; each worker's forward pass
replaced by its modelled time (docs/engine.md). Tokens are the emulated engine's on every mesh
shape, no worker loads torch, the KV handoff moves real bytes and recovers from faults,
everything says `emulated`, the simulator predicts what the mesh measures, and a 16-worker mesh
serves and stops clean."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from distserve.loadgen.emulated import EmulatedCluster, Shape, run
from distserve.local_mesh import Mesh, MeshSpec
from distserve.trace_report import main as trace_report
from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.model_spec import PRESETS
from services.common.sampling import SamplingParams
from services.common.slo import Slo
from services.engine.config import Emulation, EngineConfig
from services.engine.engine import LLMEngine
from services.engine.presets import emulated_model
from services.planner.simulator import simulate
from services.planner.workload import LengthDist, Workload
from tests.conftest import stop_now
from tests.test_mesh import addresses, kv_all_free, stats, wait_until
from tests.test_observability import scrape, value

PROMPTS = [[5] * 40, list(range(4, 300)), [9, 8, 7] * 100]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def opt13b():
    return emulated_model(PRESETS["opt-13b"])


@pytest.fixture(scope="module")
def engine_tokens(opt13b):
    """What the in-process emulated engine generates for PROMPTS (greedy)."""
    engine = LLMEngine(opt13b, EngineConfig(emulation=Emulation()), detokenize=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in engine.generate(PROMPTS, params)]


def emulated_mesh(model, **kwargs) -> Mesh:
    spec = MeshSpec(model=model, gateway_port=0, engine="emulated", **kwargs)
    mesh = Mesh(spec)
    mesh.start()
    return mesh


async def generate_ids(
    address: str, prompt: list[int], max_tokens: int = MAX_TOKENS
) -> tuple[list[int], dict]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        params = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=params
        )
        call = stub.Generate(request)
        ids = [i async for r in call for i in r.token_ids]
        return ids, dict(await call.initial_metadata())


def all_ids(mesh) -> list[list[int]]:
    async def run_all():
        return await asyncio.gather(*(generate_ids(mesh.gateway_address, p) for p in PROMPTS))

    return [ids for ids, _ in asyncio.run(asyncio.wait_for(run_all(), 60))]


@pytest.mark.parametrize(
    "shape",
    [
        {"prefill": 1, "decode": 1},
        {"prefill": 2, "decode": 1},
        {"prefill": 0, "decode": 0, "colocated": 1},
        # the KV arrives in 8-token blocks and is converted into the decode cache's 16
        {"prefill": 1, "decode": 1, "prefill_args": ("--block-size", "8")},
    ],
    ids=["1P1D", "2P1D", "colocated", "1P1D-other-block-size"],
)
def test_emulated_tokens_are_the_engines_on_every_mesh_shape(opt13b, engine_tokens, shape):
    mesh = emulated_mesh(opt13b, **shape)
    try:
        assert all_ids(mesh) == engine_tokens
        wait_until(lambda: kv_all_free(mesh), what="KV to be freed on every worker")
    finally:
        stop_now(mesh)


@pytest.mark.parametrize(
    "shape",
    [{"prefill": 1, "decode": 1}, {"prefill": 0, "decode": 0, "colocated": 1}],
    ids=["1P1D", "colocated"],
)
def test_an_emulated_worker_never_loads_torch(opt13b, engine_tokens, shape):
    """An emulated worker's KV payload is a numpy array and its steps are modelled: torch
    (~200 MB resident, ~1.3 s to import) would be dead weight in every worker of a large mesh.
    Checked from outside, after each role served: no file of the torch package is mapped."""
    torch_dir = os.path.realpath(importlib.util.find_spec("torch").submodule_search_locations[0])
    mesh = emulated_mesh(opt13b, **shape)
    try:
        assert all_ids(mesh) == engine_tokens  # prefilled, pulled (1P1D) and decoded
        for worker in mesh.workers:
            maps = Path(f"/proc/{worker.popen.pid}/maps").read_text()
            assert torch_dir not in maps, f"{worker.name} loaded torch"
    finally:
        stop_now(mesh)


def test_the_emulated_handoff_moves_bytes_and_refetches_a_corrupt_chunk(opt13b, engine_tokens):
    mesh = emulated_mesh(
        opt13b,
        prefill=1,
        decode=1,
        prefill_args=("--kv-faults", "corrupt@2"),
        decode_args=("--chunk-timeout-s", "2"),
    )
    try:
        assert all_ids(mesh) == engine_tokens
        d = stats(addresses(mesh, "decode")[0], "decode")
        assert d.pulls_total == len(PROMPTS) and d.pulls_failed == 0
        assert d.checksum_failures == 1 and d.chunks_retried >= 1
        # the payload moved for real: 2 layers x K, V x 1 head x 2 float32 per token
        tokens = sum(-(-len(p) // 16) * 16 for p in PROMPTS)
        assert d.pull_bytes_total == tokens * 2 * 2 * 2 * 4
        [decode] = [w for w in mesh.workers if w.name.startswith("decode")]
        metrics = scrape(decode.ready["metrics_address"])
        assert value(metrics, "distserve_kv_transfer_seconds_count") == len(PROMPTS)
        wait_until(lambda: kv_all_free(mesh), what="KV to be freed on both sides")
    finally:
        stop_now(mesh)


def test_an_emulated_source_killed_mid_pull_is_replaced_by_prefilling_again(opt13b, engine_tokens):
    mesh = emulated_mesh(
        opt13b,
        prefill=2,
        decode=1,
        decode_args=("--chunk-timeout-s", "2"),
        per_worker_args={"prefill-0": ("--kv-faults", "exit@2")},
    )
    try:
        ids, _ = asyncio.run(asyncio.wait_for(generate_ids(mesh.gateway_address, PROMPTS[1]), 60))
        assert ids == engine_tokens[1]
        dead = next(p for p in mesh.workers if p.name == "prefill-0")
        assert dead.popen.wait(timeout=10) == 17  # it really died mid-pull
        d = stats(addresses(mesh, "decode")[0], "decode")
        # The first pull ends either failed (its retries ran out) or aborted (the gateway saw
        # the source's stream drop first: emulated chunks are tiny, so that race goes both ways).
        assert d.pulls_total == 1 and d.pulls_failed + d.requests_aborted == 1
        assert stats(addresses(mesh, "prefill")[1], "prefill").requests_total == 1
        mesh.processes.remove(dead)
        wait_until(lambda: kv_all_free(mesh), what="KV to be freed on the live instances")
    finally:
        stop_now(mesh)


def test_a_request_waiting_for_decode_room_keeps_its_kv_past_the_lease(opt13b):
    """A decode instance full with one long request (an emulated device of 28 GiB: room for
    1,761 tokens of OPT-13B's KV) makes the next one wait for room longer than its KV's lease
    at the prefill instance (1 s): the lease is renewed while it waits, and it completes."""
    mesh = emulated_mesh(
        opt13b,
        prefill=1,
        decode=1,
        prefill_args=("--lease-s", "1"),
        decode_args=("--gpu-memory-gib", "28"),
    )
    try:

        async def both():
            long = asyncio.create_task(generate_ids(mesh.gateway_address, [7] * 1500, 150))
            await asyncio.sleep(0.5)  # its decode runs ~3 s (150 steps of ~20 ms)
            waiting = await generate_ids(mesh.gateway_address, [9] * 300, 20)
            return await long, waiting

        (long, _), (waiting, _) = asyncio.run(asyncio.wait_for(both(), 60))
        assert (len(long), len(waiting)) == (150, 20)
        p = stats(addresses(mesh, "prefill")[0], "prefill")
        assert p.leases_expired == 0
        wait_until(lambda: kv_all_free(mesh), what="KV to be freed on both sides")
    finally:
        stop_now(mesh)


def test_an_emulated_mesh_says_so_in_its_name_models_traces_and_times(opt13b, tmp_path, capsys):
    trace = tmp_path / "spans.jsonl"
    mesh = emulated_mesh(
        opt13b,
        prefill=1,
        decode=1,
        time_scale=3.0,
        env={"DISTSERVE_TRACE_FILE": str(trace), "OTEL_BSP_SCHEDULE_DELAY": "50"},
    )
    try:
        ids, metadata = asyncio.run(generate_ids(mesh.gateway_address, PROMPTS[1]))
        assert len(ids) == MAX_TOKENS
        assert metadata["x-distserve-time-scale"] == "3.0"
        url = f"http://{mesh.gateway_http_address}/v1/models"
        [model] = json.loads(urllib.request.urlopen(url, timeout=5).read())["data"]
        assert model["id"] == "opt-13b-emulated" and model["distserve_engine"] == "emulated"
        wait_until(lambda: trace.exists() and '"name":"decode"' in trace.read_text())
    finally:
        stop_now(mesh)
    spans = [json.loads(line) for line in trace.read_text().splitlines()]
    assert {s["service"] for s in spans} >= {"distserve-gateway", "distserve-decode"}
    assert all(s.get("engine") == "emulated" for s in spans)
    # In emulated time, on an idle mesh: the decode span is its 11 steps of OPT-13B on an A100
    # as the profile times them (their wall time is 3x that), within 10%.
    lat = EmulatedCluster.of("opt-13b").latency.at(1)
    n = len(PROMPTS[1])
    modelled_ms = sum(lat.decode_ms(1, n + i) for i in range(1, MAX_TOKENS))
    [decode] = [s for s in spans if s["name"] == "decode"]
    steps_ms = (decode["end_unix_nano"] - decode["start_unix_nano"]) / 1e6
    assert steps_ms == pytest.approx(modelled_ms, rel=0.1)
    assert trace_report([str(trace)]) == 0
    assert "engine: emulated" in capsys.readouterr().out


def test_the_simulator_predicts_the_emulated_1p1d_mesh_within_5_points():
    """A short fidelity check (bench/emulated/emulated.py is the full one): OPT-13B 1P1D on A100s,
    the same requests through the simulator and the mesh at three rates around the knee."""
    cluster = EmulatedCluster.of("opt-13b")
    shape = Shape(prefill=(1, 1), decode=(1, 1))
    workload = Workload(
        "short", LengthDist("uniform", low=256, high=768), LengthDist("fixed", 16, 0, 16, 16)
    )
    base = workload.sample(60, seed=3)
    slo = Slo(0.15, 0.03)
    sim = cluster.sim_cluster(shape)
    rates = (5.0, 8.0, 12.0)
    predicted = [simulate(sim, base.at_rate(r)).attainment(slo) for r in rates]
    assert predicted[0] > 0.85 and predicted[-1] < 0.6  # the rates span the knee
    time_scale = 2.0
    spec = cluster.mesh_spec(shape, emulated_model(cluster.model), time_scale)
    with Mesh(spec) as mesh:
        # Other prompts at each rate (the same lengths and arrivals): the workers' prefix cache
        # would serve a repeated prompt's prefill from the previous rate's KV, and the
        # simulator models no cache.
        measured = [
            run(mesh, time_scale, base.at_rate(r), 933, seed=i).attainment(slo)
            for i, r in enumerate(rates)
        ]
    gaps = np.abs(np.array(predicted) - np.array(measured)) * 100
    assert gaps.max() <= 5, f"predicted {predicted}, measured {measured}"


def test_a_16_worker_emulated_mesh_serves_200_requests_and_stops_clean(opt13b):
    cluster = EmulatedCluster.of("opt-13b")
    spec = cluster.mesh_spec(
        Shape(prefill=(8, 1), decode=(8, 1)), opt13b, time_scale=2.0, ready_timeout_s=300
    )
    mesh = Mesh(spec)
    mesh.start()
    try:
        workload = Workload(
            "w", LengthDist("uniform", low=16, high=512), LengthDist("uniform", low=2, high=16)
        )
        result = run(mesh, 2.0, workload.sample(200, seed=1).at_rate(40), 933, seed=0)
        assert result.ok.all(), set(result.error_message)
        assert (result.output_tokens == result.expected_tokens).all()
        wait_until(lambda: kv_all_free(mesh), what="KV to be freed on all 16 workers")
        pids = [p.popen.pid for p in mesh.processes]
    finally:
        mesh.stop()
    assert mesh.processes == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
