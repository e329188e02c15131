"""The local actuator applies placements to a running (emulated) mesh: workers start, drain and
change role while requests stream, and none fails, none loses a token, no KV stays held."""

from __future__ import annotations

import asyncio
import json
import threading

import grpc
import pytest

from distserve.local_actuator import LocalActuator, serve
from distserve.local_mesh import Mesh, MeshSpec
from services.common.errors import InvalidRequest
from services.common.model_spec import PRESETS
from services.common.sampling import SamplingParams
from services.engine.config import Emulation, EngineConfig
from services.engine.engine import LLMEngine
from services.engine.presets import emulated_model
from services.planner.actuator import RemoteActuator
from tests.conftest import stop_now
from tests.test_emulated_mesh import emulated_mesh, generate_ids
from tests.test_mesh import kv_all_free, wait_until

PROMPTS = [[5] * 40, list(range(4, 300)), [9, 8, 7] * 100, [11] * 500]
LONG = 200  # tokens: ~4 s of decode at an emulated A100's OPT-13B step, time scale 1


@pytest.fixture(scope="module")
def opt13b():
    return emulated_model(PRESETS["opt-13b"])


@pytest.fixture(scope="module")
def expected(opt13b):
    """What the in-process emulated engine generates for PROMPTS, LONG tokens each."""
    engine = LLMEngine(opt13b, EngineConfig(emulation=Emulation()), detokenize=False)
    params = SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in engine.generate(PROMPTS, params)]


class Traffic:
    """Requests streaming through the gateway on a thread of their own until stopped: a few
    at a time, each prompt of PROMPTS in turn; every result kept."""

    def __init__(self, address: str, max_tokens: int, concurrency: int = 3) -> None:
        self.address, self.max_tokens, self.concurrency = address, max_tokens, concurrency
        self.results: list[tuple[int, list[int] | BaseException]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()))

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=120)

    async def _run(self) -> None:
        async def one(i: int) -> None:
            while not self._stop.is_set():
                try:
                    ids, _ = await asyncio.wait_for(
                        generate_ids(self.address, PROMPTS[i], self.max_tokens), 60
                    )
                    self.results.append((i, ids))
                except Exception as e:  # kept: the test says which
                    self.results.append((i, e))
                i = (i + 1) % len(PROMPTS)

        await asyncio.gather(*(one(i % len(PROMPTS)) for i in range(self.concurrency)))


def check(results, expected, max_tokens: int) -> None:
    failed = [r for _, r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of {len(results)} requests failed, first: {failed[0]!r}"
    for i, ids in results:
        assert ids == expected[i][:max_tokens]


def test_a_mesh_goes_from_1p1d_to_2p1d_and_back_while_it_serves(opt13b, expected):
    mesh = emulated_mesh(opt13b, prefill=1, decode=1, drain_timeout_s=10)
    try:
        actuator = LocalActuator(mesh)
        with Traffic(mesh.gateway_address, max_tokens=24) as traffic:
            # as the Actuator service applies it: on a thread of its own, which then ends
            actuator.apply_in_background("default", {"prefill": 2})
            wait_until(lambda: not actuator.status().changing, what="the change to land")
            status = actuator.status()
            assert [(i.name, i.state) for i in status.instances] == [
                ("decode-0", "serving"),
                ("prefill-0", "serving"),
                ("prefill-1", "serving"),
            ]
            assert not status.changing and status.count("prefill") == 2
            wait_until(lambda: len(traffic.results) >= 12, what="requests through 2P1D")
            # the worker started on the applying thread outlives it (PR_SET_PDEATHSIG is per
            # thread: it once got SIGTERM as the thread ended)
            assert [p.name for p in mesh.workers if p.popen.poll() is None] == [
                "prefill-0",
                "decode-0",
                "prefill-1",
            ]
            assert sorted(mesh.worker_loads()) == ["decode-0", "prefill-0", "prefill-1"]
            # Each serving worker's load (as the gateway has it) reaches the planner over gRPC
            server, address = serve(actuator)
            try:
                remote = RemoteActuator(address).status()
            finally:
                server.stop(0)
            assert all(i.load.total_kv_blocks > 0 for i in remote.instances), remote
            assert set(remote.loads()) == {"prefill", "decode"}
            assert remote.loads()["decode"].decode_step_ms > 0, remote.loads()
            served = len(traffic.results)
            actuator.scale("default", "prefill", 1)
            assert actuator.status().count("prefill") == 1
            wait_until(lambda: len(traffic.results) >= served + 6, what="requests through 1P1D")
        check(traffic.results, expected, 24)
        left = sorted(mesh.worker_loads())
        assert left[0] == "decode-0" and left[1:] in (["prefill-0"], ["prefill-1"])
        wait_until(lambda: kv_all_free(mesh), what="KV to be freed on every instance")
    finally:
        stop_now(mesh)


def test_scale_down_drains_in_flight_streams_to_their_exact_tokens(opt13b, expected):
    """Two decode instances, both with long streams in flight; scaling decode to one drains one
    of them: its streams end with exactly the tokens a single engine gives (finished there, or
    moved to the other instance and continued)."""
    mesh = emulated_mesh(opt13b, prefill=1, decode=2, drain_timeout_s=2)
    try:
        actuator = LocalActuator(mesh)

        async def streams():
            tasks = [
                asyncio.create_task(generate_ids(mesh.gateway_address, PROMPTS[i], LONG))
                for i in range(len(PROMPTS))
            ]
            wait = asyncio.to_thread(wait_until, lambda: _decoding(mesh) == 2, what="both busy")
            await wait
            await asyncio.to_thread(actuator.scale, "default", "decode", 1)
            return [ids for ids, _ in await asyncio.gather(*tasks)]

        results = asyncio.run(asyncio.wait_for(streams(), 90))
        assert results == expected
        assert actuator.status().count("decode") == 1
        assert len([w for w in mesh.workers if w.name.startswith("decode")]) == 1
        wait_until(lambda: kv_all_free(mesh), what="KV to be freed on every instance")
    finally:
        stop_now(mesh)


def _decoding(mesh) -> int:
    """Decode instances with a sequence in their batch now."""
    loads = mesh.worker_loads()
    return sum(1 for name, load in loads.items() if name.startswith("decode") and load.running_seqs)


def test_a_role_change_drains_first_so_a_budget_is_never_exceeded(opt13b):
    mesh = emulated_mesh(opt13b, prefill=2, decode=1)
    try:
        actuator = LocalActuator(mesh)
        seen: list[int] = []
        watching = threading.Event()

        def watch():
            while not watching.is_set():
                seen.append(len(actuator.status().instances))
                watching.wait(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        actuator.apply("default", {"prefill": 1, "decode": 2})
        watching.set()
        watcher.join()
        assert max(seen) <= 3
        names = sorted(p.name for p in mesh.workers)
        assert names in (
            ["decode-0", "decode-1", "prefill-0"],
            ["decode-0", "decode-1", "prefill-1"],
        )
        ids, _ = asyncio.run(asyncio.wait_for(generate_ids(mesh.gateway_address, PROMPTS[0]), 30))
        assert len(ids) == 12
    finally:
        stop_now(mesh)


def test_a_role_is_resharded_new_instance_first_within_the_budget_while_it_serves(opt13b, expected):
    """decode tp 1 -> tp 2 on a 1P1D with a budget of 4: the tp-2 instance starts beside the
    old one (4 devices, never more), then the old drains; requests stream throughout with exact
    tokens, the new instance holds a tp-2 device's KV, no KV stays held. A re-shard the budget
    leaves no room for beside the role's only instance is refused and changes nothing."""
    mesh = emulated_mesh(opt13b, prefill=1, decode=1, budget=4, drain_timeout_s=10)
    try:
        actuator = LocalActuator(mesh)
        server, address = serve(actuator)
        remote = RemoteActuator(address)
        blocks_tp1 = mesh.worker_loads()["decode-0"].total_kv_blocks
        devices: list[int] = []
        watching = threading.Event()

        def watch():
            while not watching.wait(0.02):
                devices.append(sum(i.tp for i in actuator.status().instances))

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with Traffic(mesh.gateway_address, max_tokens=24) as traffic:
                wait_until(lambda: len(traffic.results) >= 3, what="requests through tp 1")
                # as the planner asks it: over gRPC, applied in the background
                remote.apply("default", {"decode": 1}, tp={"decode": 2})
                wait_until(lambda: not actuator.status().changing, what="the re-shard")
                served = len(traffic.results)
                wait_until(lambda: len(traffic.results) >= served + 6, what="requests via tp 2")
        finally:
            watching.set()
            watcher.join()
        check(traffic.results, expected, 24)
        status = actuator.status()
        assert [(i.name, i.state, i.tp) for i in status.instances] == [
            ("decode-1", "serving", 2),
            ("prefill-0", "serving", 1),
        ]
        assert status.describe() == "decode x1 (tp 2), prefill x1"
        assert remote.status().tp("decode") == 2
        assert max(devices) == 4, devices  # both decode instances at once, never more
        assert mesh.worker_loads()["decode-1"].total_kv_blocks > 2 * blocks_tp1
        with pytest.raises(grpc.RpcError) as refused:
            remote.apply("default", {"prefill": 1}, tp={"prefill": 4})
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "no room in a budget of 4" in refused.value.details()
        assert actuator.status().describe() == "decode x1 (tp 2), prefill x1"
        assert not actuator.status().changing
        wait_until(lambda: kv_all_free(mesh), what="KV to be freed on every instance")
        remote.close()
        server.stop(0)
    finally:
        stop_now(mesh)


def test_the_actuator_refuses_what_it_cannot_do(opt13b):
    mesh = emulated_mesh(opt13b, prefill=1, decode=1)
    try:
        actuator = LocalActuator(mesh)
        with pytest.raises(InvalidRequest, match="no pool 'big'"):
            actuator.scale("big", "prefill", 2)
        with pytest.raises(InvalidRequest, match="no role 'encode'"):
            actuator.scale("default", "encode", 1)
        with pytest.raises(InvalidRequest, match=">= 0"):
            actuator.scale("default", "decode", -1)
        with pytest.raises(InvalidRequest, match="no worker named 'decode-7'"):
            actuator.drain("decode-7")
        assert actuator.status().count("prefill") == actuator.status().count("decode") == 1
    finally:
        stop_now(mesh)


def test_the_planner_resizes_a_running_mesh_to_its_load_and_back_when_idle(opt13b, capsys):
    """`distserve up --planner --budget 4` on an emulated 1P1D: summarisation (long prompts)
    at 3 req/s with a TTFT SLO of 250 ms is more than one prefill instance meets (~56%): the
    planner adds prefill; once the load stops and a whole window is idle it returns to 1P1D.
    No request fails, the budget is never exceeded, no KV stays held."""
    from distserve.cli import main
    from distserve.loadgen.emulated import run
    from services.planner.workload import PRESETS as WORKLOADS

    mesh = emulated_mesh(
        opt13b,
        prefill=1,
        decode=1,
        planner=True,
        budget=4,
        planner_args=(
            "--model-spec",
            "opt-13b",
            "--slo",
            "250,100",
            "--decide-every-s",
            "1",
            "--window-s",
            "15",
            "--cooldown-s",
            "3",
        ),
    )
    try:
        devices: list[int] = []
        watching = threading.Event()

        def watch():
            while not watching.wait(0.1):
                devices.append(sum(1 for i in mesh.actuator.status().instances))

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            requests = WORKLOADS["summarization"].sample(150, seed=1).at_rate(3.0)
            result = run(mesh, 1.0, requests, vocab(opt13b), seed=1)
            grown = mesh.actuator.status()
            wait_until(
                lambda: (
                    [w.name for w in mesh.workers if w.name.startswith("prefill")] == ["prefill-0"]
                ),
                timeout=60,
                what="the idle mesh to shrink back to one prefill instance",
            )
        finally:
            watching.set()
            watcher.join()
        failed = [m for e, m in zip(result.error, result.error_message, strict=True) if e]
        assert result.ok.all(), failed[:3]
        assert grown.changes >= 1 and max(devices) > 2, (grown, max(devices))
        assert max(devices) <= 4
        wait_until(lambda: kv_all_free(mesh), what="KV to be freed on every instance")
        # What it decided is visible: metrics, and `distserve plan --watch`.
        (planner,) = [p for p in mesh.processes if p.name == "planner"]
        decisions = {
            s.labels["action"]: s.value
            for s in planner.metrics()
            if s.name == "distserve_planner_decisions_total"
        }
        assert decisions.get("scale", 0) >= 2 and decisions.get("hold", 0) >= 1, decisions
        assert main(["plan", "--watch", planner.ready["address"], "--every-s", "0"]) == 0
        (line,) = capsys.readouterr().out.splitlines()
        assert "prefill=1" in line and "(budget 4)" in line, line
        assert "; decode: " in line and "running, KV" in line, line  # the loads it saw
    finally:
        stop_now(mesh)


def vocab(model) -> int:
    return json.loads((model / "config.json").read_text())["vocab_size"]


def test_worker_loads_before_the_gateway_is_up_are_none_and_leave_no_channel(tmp_path):
    """The planner starts before the gateway and asks for loads at once: that answer is empty,
    and keeps no channel to no address (which failed every later status and so every apply)."""
    mesh = Mesh(MeshSpec(model=tmp_path))
    assert mesh.worker_loads() == {}
    assert mesh._registry is None
