"""Tensor-parallel instances behind one endpoint: real processes (rank 0 serving gRPC, the other
ranks its children), the tiny model on CPU (gloo). One mesh holds an instance of each kind and
degree; the handoff tests drive Prefill and Decode directly, each pairing the instances it
names."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import grpc
import pytest

from services.common.gen.distserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from services.common.kv_handle import KvHandle
from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from tests.conftest import start_mesh
from tests.test_mesh import kv_all_free, stats, wait_until

TP2 = ("--tensor-parallel-size", "2", "--threads", "1")


def _free_pair() -> int:
    """A port p with p and p + 1 free now (prefill-1's two ranks' UCX listeners)."""
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


UCX_BASE = _free_pair()
# prefill-0 and decode-0 are tp=1, the others tp=2; the colocated ones are killed at the end.
# prefill-1 is given its UCX port: rank r listens on it + r (what a NetworkPolicy names).
WORKERS = {
    "prefill-1": (*TP2, "--ucx-port", str(UCX_BASE)),
    "decode-1": TP2,
    "colocated-0": TP2,
    "colocated-1": TP2,
}
MAX_TOKENS = 12
PROMPTS = [list(range(5, 45)), [7 + (i * 13) % 200 for i in range(70)]]  # 3 and 5 blocks of 16


@pytest.fixture(scope="module")
def mesh(tiny_model):
    mesh = start_mesh(tiny_model, prefill=2, decode=2, colocated=2, per_worker_args=WORKERS)
    yield mesh
    mesh.stop()


@pytest.fixture(scope="module")
def reference(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=256))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in engine.generate(PROMPTS, params)]


def _address(mesh, name: str) -> str:
    return next(w.ready["address"] for w in mesh.workers if w.name == name)


def _sampling() -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


async def _decode(address: str, request_id: str, prompt, kv=None, first=None) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        request = decode_pb2.DecodeRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=_sampling(), kv=kv
        )
        if first is not None:
            request.first_token_id = first
        ids = []
        async for r in decode_pb2_grpc.DecodeStub(channel).Decode(request, timeout=60):
            ids += r.token_ids
        return ids


async def _handoff(prefill: str, decode: str, request_id: str, prompt, layerwise: bool):
    """Prefill on one instance, decode on another with the handle; (tokens, handle). `layerwise`:
    the layer-wise handoff (the decode pulls while the prompt is computed)."""
    async with grpc.aio.insecure_channel(prefill) as channel:
        calls = prefill_pb2_grpc.PrefillStub(channel).Prefill(
            prefill_pb2.PrefillRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling=_sampling(),
                layerwise=layerwise,
            ),
            timeout=60,
        )
        pulling = None
        async for event in calls:
            if event.HasField("kv"):  # the layer-wise handle: pull while prefill computes
                handle = event.kv
                pulling = asyncio.ensure_future(_decode(decode, request_id, prompt, handle))
            else:
                done = event.done
        if pulling is None:
            handle = done.kv
            rest = await _decode(decode, request_id, prompt, handle, done.first_token_id)
        else:
            rest = await pulling
    return [done.first_token_id, *rest], KvHandle.from_pb(handle)


def _by_rank(mesh, name: str) -> list[int]:
    role = name.split("-")[0]
    s = stats(_address(mesh, name), role)
    return list(s.kv_bytes_served_by_rank if role == "prefill" else s.pull_bytes_by_rank)


def _minus(after: list[int], before: list[int]) -> list[int]:
    return [a - b for a, b in zip(after, before, strict=True)]


@pytest.mark.parametrize(
    ("prefill", "decode"),
    [("prefill-1", "decode-0"), ("prefill-0", "decode-1"), ("prefill-1", "decode-1")],
    ids=["P-tp2-D-tp1", "P-tp1-D-tp2", "P-tp2-D-tp2"],
)
@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "after-prefill"])
def test_each_decode_rank_pulls_its_heads_from_the_prefill_ranks_holding_them(
    mesh, reference, prefill, decode, layerwise
):
    """Tokens equal the in-process engine's; every rank of either side moved exactly its share
    of the bytes (so each decode rank pulled its own heads, from the source ranks that hold
    them, and none went through another rank); nothing stays held on either side. The mesh is
    shared by the cases and the prompts repeat: a decode instance that saw them before holds
    their full blocks in its prefix cache and pulls only the rest, on every rank alike."""
    p = 2 if prefill == "prefill-1" else 1
    d = 2 if decode == "decode-1" else 1
    served, pulled = _by_rank(mesh, prefill), _by_rank(mesh, decode)
    reused_before = stats(_address(mesh, decode), "decode").prompt_tokens_cached

    async def both():
        return await asyncio.gather(
            *(
                _handoff(
                    _address(mesh, prefill),
                    _address(mesh, decode),
                    f"{i}-{layerwise}",
                    q,
                    layerwise,
                )
                for i, q in enumerate(PROMPTS)
            )
        )

    results = asyncio.run(both())
    total = 0
    for (tokens, handle), want in zip(results, reference, strict=True):
        assert tokens == want
        assert handle.layerwise is layerwise
        assert len(handle.rank_sources) == (p if p > 1 else 0)
        if prefill == "prefill-1":
            assert [r.ucx_port for r in handle.rank_sources] == [UCX_BASE, UCX_BASE + 1]
        total += handle.total_bytes
    reused = stats(_address(mesh, decode), "decode").prompt_tokens_cached - reused_before
    total -= reused // handle.block_size * 2 * handle.block_bytes * handle.num_layers
    assert _minus(_by_rank(mesh, decode), pulled) == [total // d] * d
    # A follower's count arrives as each of its leases ends.
    wait_until(
        lambda: _minus(_by_rank(mesh, prefill), served) == [total // p] * p,
        what=f"each of the {p} prefill ranks to have served 1/{p} of {total} bytes",
    )
    wait_until(lambda: kv_all_free(mesh), what="KV blocks to be freed everywhere")


def test_colocated_tp2_gives_the_greedy_tokens_of_tp1(mesh, reference):
    async def both():
        address = _address(mesh, "colocated-0")
        return await asyncio.gather(*(_decode(address, f"c{i}", q) for i, q in enumerate(PROMPTS)))

    assert asyncio.run(both()) == reference


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize(
    ("victim", "name"), [("follower", "colocated-0"), ("rank0", "colocated-1")]
)
def test_a_tp_group_dies_together(mesh, victim, name):
    """Kill rank 0 (even with SIGKILL): its follower ranks die with it (orphan guard). Kill a
    follower: rank 0 exits too, since the group's collectives could never complete."""
    worker = next(w for w in mesh.workers if w.name == name).popen
    (follower,) = _children(worker.pid)  # the orphan guard execs into the rank
    os.kill(worker.pid if victim == "rank0" else follower, signal.SIGKILL)
    survivor = follower if victim == "rank0" else worker.pid
    deadline = time.monotonic() + 20
    while _alive(survivor) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(survivor), f"{'follower' if victim == 'rank0' else 'rank 0'} outlived"
