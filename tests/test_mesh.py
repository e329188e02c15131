"""The mesh end to end: real processes, real sockets, real UCX, the tiny model.

Why one file (~490 lines): most tests share one started 1P1D mesh (a module fixture: starting it
is the expensive part), and the rest are `distserve up` itself started and stopped as a user
would; splitting them would start the mesh once per file."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from services.common.gen.distserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    kvtransfer_pb2,
    kvtransfer_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine

PROMPTS = [
    "Hello",
    "The decode phase adds one token at a time",
    "A longer prompt: " + "prefill reads the whole prompt at once and writes the cache; " * 6,
    "東京 café 🙂",
]


_EXPECTED: dict[tuple, list[tuple[list[int], str]]] = {}


def expected(model, prompts, max_tokens=24):
    """[(token ids, text)] of the in-process engine, greedy: computed once per (model, prompts,
    max_tokens) in the session (the engine is deterministic; a run costs 0.2-3 s)."""
    key = (str(model), tuple(prompts), max_tokens)
    if key not in _EXPECTED:
        engine = LLMEngine(model, EngineConfig(num_blocks=256))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        _EXPECTED[key] = [(c.token_ids, c.text) for c in engine.generate(list(prompts), params)]
    return [(list(ids), text) for ids, text in _EXPECTED[key]]


async def generate(address, prompt, max_tokens=24, **sampling):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        params = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
        ids, text, last = [], [], None
        async for r in stub.Generate(gateway_pb2.GenerateRequest(text=prompt, sampling=params)):
            ids += r.token_ids
            text.append(r.text)
            last = r
        return ids, "".join(text), last


def stats(address, service):
    with grpc.insecure_channel(address) as channel:
        stub = (
            prefill_pb2_grpc.PrefillStub if service == "prefill" else decode_pb2_grpc.DecodeStub
        )(channel)
        return stub.Stats(common_pb2.StatsRequest(), timeout=5)


def addresses(mesh, role):
    return [p.ready["address"] for p in mesh.workers if p.name.startswith(role)]


def wait_until(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def kv_all_free(mesh) -> bool:
    for role in ("prefill", "decode"):
        for a in addresses(mesh, role):
            s = stats(a, role)
            if s.load.free_kv_blocks != s.load.total_kv_blocks or s.load.held_kv_handles:
                return False
    return True


@pytest.fixture(scope="module")
def mesh_1p1d(shared_mesh):
    """The session's 1P1D mesh (the tests using it leave it as they found it)."""
    return shared_mesh


@pytest.mark.parametrize(
    "shape", [(1, 1, 0), (2, 1, 0), (1, 2, 0), (0, 0, 1)], ids=["1P1D", "2P1D", "1P2D", "colocated"]
)
def test_greedy_output_through_the_mesh_equals_the_engine(
    mesh_factory, mesh_1p1d, tiny_model, shape
):
    p, d, c = shape
    mesh = mesh_1p1d if shape == (1, 1, 0) else mesh_factory(prefill=p, decode=d, colocated=c)

    async def run_all():
        # Concurrently, so that routing spreads requests over the instances of each pool.
        return await asyncio.gather(*(generate(mesh.gateway_address, q) for q in PROMPTS * 2))

    results = asyncio.run(run_all())
    want = expected(tiny_model, PROMPTS) * 2
    for (ids, text, last), (want_ids, want_text) in zip(results, want, strict=True):
        assert ids == want_ids
        assert text == want_text
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == len(want_ids)
    for role in ("prefill", "decode"):
        for address in addresses(mesh, role):
            assert stats(address, role).requests_total > 0, f"a {role} instance got no traffic"
    if c:
        assert all(stats(a, "decode").requests_total > 0 for a in addresses(mesh, "colocated"))
    wait_until(lambda: kv_all_free(mesh), what="KV blocks to be freed everywhere")


def test_32_concurrent_requests_of_mixed_lengths(mesh_1p1d, tiny_model):
    prompts = [f"request {i}: " + "word " * (i * 7 % 90) for i in range(32)]
    lengths = [4 + (i * 5) % 29 for i in range(32)]

    async def run_all():
        return await asyncio.gather(
            *(
                generate(mesh_1p1d.gateway_address, q, n)
                for q, n in zip(prompts, lengths, strict=True)
            )
        )

    results = asyncio.run(run_all())
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=512))
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    want = engine.generate(prompts, params)
    assert [r[0] for r in results] == [w.token_ids for w in want]
    wait_until(lambda: kv_all_free(mesh_1p1d), what="KV blocks to be freed everywhere")


def test_cancel_mid_stream_frees_kv_on_prefill_and_decode(mesh_1p1d):
    async def cancel_after_tokens():
        async with grpc.aio.insecure_channel(mesh_1p1d.gateway_address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            params = common_pb2.SamplingParams(max_tokens=900, ignore_eos=True)
            call = stub.Generate(gateway_pb2.GenerateRequest(text="cancel me", sampling=params))
            got = 0
            async for r in call:
                got += len(r.token_ids)
                if got >= 5:
                    # The request is decoding: it holds blocks on the decode instance.
                    d = stats(addresses(mesh_1p1d, "decode")[0], "decode")
                    assert d.load.running_seqs == 1
                    assert d.load.free_kv_blocks < d.load.total_kv_blocks
                    call.cancel()
                    break
            return got

    assert asyncio.run(cancel_after_tokens()) >= 5
    wait_until(lambda: kv_all_free(mesh_1p1d), what="KV blocks to be freed after cancel")
    d = stats(addresses(mesh_1p1d, "decode")[0], "decode")
    assert d.requests_aborted >= 1 and d.load.running_seqs == 0


def test_a_lapsed_lease_frees_kv_nobody_pulled(mesh_factory):
    mesh = mesh_factory(prefill=1, decode=0, colocated=1, prefill_args=("--lease-s", "1"))
    address = addresses(mesh, "prefill")[0]
    with grpc.insecure_channel(address) as channel:
        [event] = prefill_pb2_grpc.PrefillStub(channel).Prefill(
            prefill_pb2.PrefillRequest(
                request_id="orphan",
                prompt_token_ids=list(range(5, 60)),
                sampling=common_pb2.SamplingParams(max_tokens=10, ignore_eos=True),
            ),
            timeout=30,
        )
        reply = event.done
        assert reply.HasField("kv") and reply.kv.access_token
        held = stats(address, "prefill")
        assert held.load.held_kv_handles == 1
        assert held.load.free_kv_blocks < held.load.total_kv_blocks
        # A wrong access token is refused by the control plane.
        control = kvtransfer_pb2_grpc.KvTransferStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            control.Describe(
                kvtransfer_pb2.KvAccess(handle_id=reply.kv.handle_id, access_token="x")
            )
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    wait_until(
        lambda: stats(address, "prefill").leases_expired == 1, timeout=10, what="lease lapse"
    )
    s = stats(address, "prefill")
    assert s.load.held_kv_handles == 0 and s.blocks_reclaimed > 0
    assert s.load.free_kv_blocks == s.load.total_kv_blocks
    # ... and the prefill instance's Prometheus endpoint says the same.
    [prefill] = [w for w in mesh.workers if w.name.startswith("prefill")]
    metrics = {m.name: m.value for m in prefill.metrics()}
    assert metrics["distserve_kv_leases_expired_total"] == 1
    assert metrics["distserve_kv_blocks_reclaimed_total"] == s.blocks_reclaimed


def test_a_silent_worker_is_dropped_and_a_new_one_gets_traffic(mesh_factory, tiny_model):
    mesh = mesh_factory(prefill=2, decode=1, gateway_args=("--worker-lease-s", "1"))

    def listed():
        with grpc.insecure_channel(mesh.gateway_address) as channel:
            stub = gateway_pb2_grpc.WorkerRegistryStub(channel)
            return {w.worker_id for w in stub.ListWorkers(gateway_pb2.ListWorkersRequest()).workers}

    silent = next(p for p in mesh.workers if p.name == "prefill-1")
    silent.popen.send_signal(signal.SIGSTOP)  # alive but silent: no heartbeats
    try:
        wait_until(lambda: "prefill-1" not in listed(), timeout=10, what="prefill-1 dropped")

        # Requests keep working on the remaining instance, none reaches the silent one.
        async def run_all():
            return await asyncio.gather(*(generate(mesh.gateway_address, q) for q in PROMPTS))

        results = asyncio.run(asyncio.wait_for(run_all(), 60))
        assert [r[0] for r in results] == [w[0] for w in expected(tiny_model, PROMPTS)]
    finally:
        silent.popen.send_signal(signal.SIGCONT)
    # Heartbeating again, it is told it is unknown, registers anew and takes traffic.
    wait_until(lambda: "prefill-1" in listed(), timeout=10, what="prefill-1 back")
    before = stats(silent.ready["address"], "prefill").requests_total

    async def burst():
        return await asyncio.gather(*(generate(mesh.gateway_address, q) for q in PROMPTS * 3))

    asyncio.run(burst())
    assert stats(silent.ready["address"], "prefill").requests_total > before


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        ({}, "give a prompt"),
        ({"text": ""}, "prompt is empty"),
        ({"token_ids": gateway_pb2.TokenIds(ids=[])}, "prompt is empty"),
        ({"token_ids": gateway_pb2.TokenIds(ids=[5, 99999])}, "outside the vocabulary"),
        ({"text": "x", "sampling": common_pb2.SamplingParams(max_tokens=5000)}, "max_tokens"),
        ({"text": "x", "sampling": common_pb2.SamplingParams(temperature=-1)}, "temperature"),
        ({"text": "x", "sampling": common_pb2.SamplingParams(top_p=1.5)}, "top_p"),
        ({"text": "x", "sampling": common_pb2.SamplingParams(stop=[""])}, "stop strings"),
    ],
)
def test_bad_input_is_invalid_argument_with_a_message(mesh_1p1d, request_fields, message):
    with grpc.insecure_channel(mesh_1p1d.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(gateway_pb2.GenerateRequest(**request_fields), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()


def test_distserve_up_serves_and_stops_every_process_on_sigterm(tiny_model, tmp_path):
    argv = ["up", "--model", str(tiny_model), "--port", "0", "--edge-port", "0"]
    argv += ["--decode-args", "--max-model-len 300", "--gateway-args", "--routing load"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "distserve.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "serving" in line:
                break
        gateway = next(ln.split()[-1] for ln in lines if "gateway (gRPC) on" in ln)
        ids, _, last = asyncio.run(generate(gateway, "Hello", 5))
        assert len(ids) == 5 and last.usage.completion_tokens == 5
        edge = next(ln.split("http://")[1].split()[0] for ln in lines if "edge (Envoy" in ln)
        ids, _, _ = asyncio.run(generate(edge, "Hello", 5))
        assert len(ids) == 5
        # --decode-args reached the decode worker: the gateway serves its max_model_len.
        with pytest.raises(grpc.RpcError, match=r"exceeds max_model_len \(300 tokens\)"):
            asyncio.run(generate(gateway, "Hello", 299))
        children = children_of(proc.pid)
        assert len(children) == 5  # etcd, gateway, prefill, decode, envoy
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        for pid in children:
            status = Path(f"/proc/{pid}/status")
            alive = status.exists() and "zombie" not in status.read_text().lower()
            assert not alive, f"process {pid} outlived distserve up"
        assert list(tmp_path.iterdir()) == []  # nothing left behind in the working directory
    finally:
        if proc.poll() is None:
            proc.kill()


def children_of(pid: int) -> list[int]:
    """The processes `pid` forked, from any of its threads (the launcher forks from one of its
    own: services/common/orphan_guard.py)."""
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


def test_every_process_dies_with_a_killed_distserve_up(tiny_model, tmp_path):
    """SIGKILL leaves no process and no file behind (Envoy's configuration folder included)."""
    argv = ["up", "--model", str(tiny_model), "--port", "0", "--edge-port", "0"]
    scratch = tmp_path / "tmp"  # the mesh's TMPDIR
    scratch.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "distserve.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    try:
        for line in proc.stdout:
            if "serving" in line:
                break
        children = children_of(proc.pid)
        assert len(children) == 5  # etcd, gateway, prefill, decode, envoy
        proc.kill()  # no chance to stop them: the kernel tells them (PR_SET_PDEATHSIG)
        proc.wait()

        def alive(pid):
            status = Path(f"/proc/{pid}/status")
            return status.exists() and "zombie" not in status.read_text().lower()

        wait_until(lambda: not any(alive(pid) for pid in children), 30, "children to exit")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tmp"]
        # (torch keeps its compile cache there: shared by every run, not one mesh's)
        assert [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")] == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_requests_ending_at_their_first_token_leave_decode_alive(mesh_1p1d, tiny_model):
    """With the layer-wise handoff the gateway cancels a decode call that is pulling when the
    first token ends the request (here: it is a stop token); no abandoned UCX receive may
    outlive its buffer (this once crashed the decode instance with SIGSEGV on the second such
    request). A request for one token starts no decode call at all."""
    [(first, _)] = expected(tiny_model, ["Hello there"], 1)
    decode = addresses(mesh_1p1d, "decode")[0]
    calls = stats(decode, "decode").requests_total
    for _ in range(3):
        ids, _, last = asyncio.run(generate(mesh_1p1d.gateway_address, "Hello there", 1))
        assert len(ids) == 1 and last.usage.completion_tokens == 1
    assert stats(decode, "decode").requests_total == calls
    for _ in range(6):
        ids, _, last = asyncio.run(
            generate(mesh_1p1d.gateway_address, "Hello there", 5, stop_token_ids=first)
        )
        assert ids == first and last.usage.completion_tokens == 1
    time.sleep(1.0)
    assert all(p.popen.poll() is None for p in mesh_1p1d.processes)
    ids, _, _ = asyncio.run(generate(mesh_1p1d.gateway_address, "Hello there", 5))
    assert len(ids) == 5
    wait_until(lambda: kv_all_free(mesh_1p1d), what="KV freed after one-token requests")


def test_two_concurrent_requests_with_one_id_both_end(mesh_1p1d):
    async def both():
        async with grpc.aio.insecure_channel(mesh_1p1d.gateway_address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)

            async def one(i):
                params = common_pb2.SamplingParams(max_tokens=8, ignore_eos=True)
                req = gateway_pb2.GenerateRequest(
                    text=f"Hi {i}", request_id="one-id", sampling=params
                )
                try:
                    return len([r async for r in stub.Generate(req, timeout=20)])
                except grpc.aio.AioRpcError as e:
                    return e.code()

            return await asyncio.gather(one(0), one(1))

    results = asyncio.run(both())
    # One is served; the other is refused at once (the id is in use) or served after it.
    assert any(isinstance(r, int) and r > 0 for r in results), results
    assert all(isinstance(r, int) or r == grpc.StatusCode.INVALID_ARGUMENT for r in results)
    wait_until(lambda: kv_all_free(mesh_1p1d), what="KV freed")


def test_a_deadline_ends_the_request_everywhere(mesh_1p1d):
    with grpc.insecure_channel(mesh_1p1d.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        params = common_pb2.SamplingParams(max_tokens=1000, ignore_eos=True)
        request = gateway_pb2.GenerateRequest(text="x", sampling=params, timeout_ms=300)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request, timeout=30))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: kv_all_free(mesh_1p1d), what="KV blocks to be freed after the deadline")


def test_kv_in_another_block_size_and_dtype_is_staged_and_exact(mesh_factory, tiny_model):
    mesh = mesh_factory(
        prefill=1,
        decode=1,
        prefill_args=("--block-size", "8", "--dtype", "float16"),
        decode_args=("--block-size", "16"),
    )
    ids, _, _ = asyncio.run(generate(mesh.gateway_address, PROMPTS[2]))
    assert ids == staged_reference(tiny_model, PROMPTS[2])
    s = stats(addresses(mesh, "decode")[0], "decode")
    assert s.pulls_total == 1 and s.pull_bytes_total > 0
    wait_until(lambda: kv_all_free(mesh), what="KV blocks to be freed everywhere")


def staged_reference(model, prompt: str) -> list[int]:
    """In process: float16 prefill with 8-token blocks, its KV converted into a float32 engine
    with 16-token blocks, which decodes. What the mesh must reproduce exactly."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prefill = LLMEngine(model, EngineConfig(num_blocks=64, block_size=8, dtype="float16"))
    decode = LLMEngine(model, EngineConfig(num_blocks=64, block_size=16))
    prefill.add_request(prompt, params, request_id="r")
    [first] = prefill.prefill_step(hold=True)
    src = prefill.sequence("r")
    n = src.num_prompt_tokens
    decode.add_prefilled(src.token_ids[:n], first.new_token_ids[0], params, "r")
    [seq] = decode.admit_pulls()
    pos = torch.arange(n)
    src_slots = torch.tensor(src.block_table.blocks)[pos // 8] * 8 + pos % 8
    for layer in range(decode.model_config.num_layers):
        for kv in (0, 1):
            tokens = prefill.runner.cache.layer(layer)[kv][src_slots]
            decode.runner.cache.write_tokens(layer, kv, seq.block_table.blocks, tokens)
    decode.start_decoding("r")
    ids = list(first.new_token_ids)
    while decode.has_unfinished():
        ids += [t for o in decode.step() for t in o.new_token_ids]
    return ids


def test_kv_in_another_block_size_gives_the_same_tokens(mesh_factory, tiny_model):
    mesh = mesh_factory(
        prefill=1, decode=1, prefill_args=("--block-size", "8"), decode_args=("--block-size", "32")
    )
    ids, _, _ = asyncio.run(generate(mesh.gateway_address, PROMPTS[2]))
    assert ids == expected(tiny_model, [PROMPTS[2]])[0][0]


def test_kv_of_another_model_shape_is_refused_clearly(mesh_factory, model_factory):
    other = model_factory("tiny-mqa", num_key_value_heads=1)
    mesh = mesh_factory(prefill=1, decode=1, decode_args=("--model", str(other)))
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        params = common_pb2.SamplingParams(max_tokens=8)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(gateway_pb2.GenerateRequest(text="x", sampling=params), timeout=30))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "prefill and decode must serve the same model" in err.value.details()
    wait_until(lambda: kv_all_free(mesh), what="the held KV to be released")


def test_a_dead_prefill_instance_is_bypassed_before_its_lease_lapses(mesh_factory, tiny_model):
    mesh = mesh_factory(prefill=2, decode=1)
    dead = next(p for p in mesh.workers if p.name == "prefill-0")
    dead.popen.kill()  # prefill-0 is still registered: its lease has not lapsed yet
    dead.popen.wait()
    mesh.processes.remove(dead)

    async def run_all():
        return await asyncio.gather(*(generate(mesh.gateway_address, q) for q in PROMPTS))

    results = asyncio.run(asyncio.wait_for(run_all(), 60))
    assert [r[0] for r in results] == [w[0] for w in expected(tiny_model, PROMPTS)]


@pytest.mark.parametrize(
    ("prefill_args", "decode_args"),
    [
        ((), ("--kv-transport", "grpc")),
        (("--no-ucx",), ()),
        (("--ucx-tls", "tcp"), ("--ucx-tls", "tcp")),
    ],
    ids=["decode-chooses-grpc", "source-without-ucx", "ucx-over-tcp-only"],
)
def test_the_grpc_fallback_moves_the_same_kv(mesh_factory, tiny_model, prefill_args, decode_args):
    """The gRPC fallback, and UCX restricted to one transport, move the same KV."""
    mesh = mesh_factory(prefill=1, decode=1, prefill_args=prefill_args, decode_args=decode_args)
    ids, _, _ = asyncio.run(generate(mesh.gateway_address, PROMPTS[2]))
    assert ids == expected(tiny_model, [PROMPTS[2]])[0][0]
    d = stats(addresses(mesh, "decode")[0], "decode")
    assert d.pulls_total == 1 and d.pull_bytes_total > 0
    wait_until(lambda: kv_all_free(mesh), what="KV blocks to be freed everywhere")


def test_each_worker_reports_its_kv_capacity_and_the_gateway_serves_the_smallest(mesh_factory):
    """Pools sized by --kv-cache-gib (the tiny model's KV: 8192 bytes a block of 16 tokens):
    40 blocks on prefill, 25 on decode. Each worker's max_model_len is its pool's tokens (the
    model's 1024 do not fit); the mesh serves the smaller, and refuses longer requests."""
    import json
    import urllib.request

    block = 8192
    mesh = mesh_factory(
        prefill=1,
        decode=1,
        prefill_args=("--kv-cache-gib", str(40 * block / 2**30)),
        decode_args=("--kv-cache-gib", str(25 * block / 2**30)),
    )
    want = {"prefill-0": (40, 640), "decode-0": (25, 400)}
    for w in mesh.workers:
        blocks, tokens = want[w.name]
        assert (w.ready["kv_blocks"], w.ready["kv_block_size"]) == (blocks, 16)
        assert w.ready["kv_capacity_tokens"] == tokens and w.ready["max_model_len"] == tokens
        metrics = {m.name: m.value for m in w.metrics()}
        assert metrics["distserve_kv_capacity_tokens"] == tokens
        assert metrics["distserve_max_model_len"] == tokens
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        listed = gateway_pb2_grpc.WorkerRegistryStub(channel).ListWorkers(
            gateway_pb2.ListWorkersRequest(), timeout=5
        )
        loads = {w.worker_id: w.load for w in listed.workers}
        assert {k: (v.total_kv_blocks, v.max_model_len) for k, v in loads.items()} == want
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for ids, max_tokens, message in [
            (400, 1, "prompt has 400 tokens; max_model_len is 400 tokens"),
            (390, 20, "(20) exceeds max_model_len (400 tokens); set max_tokens <= 10"),
        ]:
            request = gateway_pb2.GenerateRequest(
                token_ids=gateway_pb2.TokenIds(ids=[5] * ids),
                sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
            )
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, timeout=10))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in err.value.details()
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=[5] * 390),
            sampling=common_pb2.SamplingParams(max_tokens=10, ignore_eos=True),
        )
        assert sum(len(r.token_ids) for r in stub.Generate(request, timeout=60)) == 10
    with urllib.request.urlopen(f"http://{mesh.gateway_http_address}/v1/models", timeout=5) as r:
        assert json.load(r)["data"][0]["max_model_len"] == 400


def test_two_gateways_behind_envoy_both_route_and_both_see_every_worker(mesh_factory, tiny_model):
    from services.edge.config import EdgeConfig

    mesh = mesh_factory(prefill=2, decode=1, gateways=2, edge=EdgeConfig(port=0))
    assert len(mesh.gateway_addresses) == 2
    for address in mesh.gateway_addresses:
        with grpc.insecure_channel(address) as channel:
            listed = gateway_pb2_grpc.WorkerRegistryStub(channel).ListWorkers(
                gateway_pb2.ListWorkersRequest(), timeout=5
            )
        assert {w.worker_id for w in listed.workers} == {"prefill-0", "prefill-1", "decode-0"}

    # Each gateway serves exact greedy output on its own, concurrently with the other ...
    async def both():
        calls = [generate(a, q) for a in mesh.gateway_addresses for q in PROMPTS[:3]]
        return await asyncio.gather(*calls)

    results = asyncio.run(asyncio.wait_for(both(), 120))
    want = [w[0] for w in expected(tiny_model, PROMPTS[:3])]
    assert [r[0] for r in results] == want * 2

    # ... and Envoy sends requests to both (least requests: concurrent ones spread).
    def served(process) -> float:
        samples = process.metrics()
        return sum(s.value for s in samples if s.name == "distserve_gateway_requests_total")

    before = [served(g) for g in mesh.gateways]

    async def through_envoy():
        return await asyncio.gather(*(generate(mesh.edge_address, q) for q in PROMPTS * 2))

    results = asyncio.run(asyncio.wait_for(through_envoy(), 120))
    assert [r[0] for r in results] == [w[0] for w in expected(tiny_model, PROMPTS)] * 2
    after = [served(g) for g in mesh.gateways]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)
    wait_until(lambda: kv_all_free(mesh), what="every block free")
