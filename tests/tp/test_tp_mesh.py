"""Tensor-parallel instances behind one endpoint: real processes (rank 0 serving gRPC, the other
ranks its children), the tiny model on CPU (gloo), driven through the gateway."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tests.conftest import start_mesh
from tests.test_mesh import PROMPTS, expected, generate, kv_all_free, stats, wait_until

TP2 = ("--tensor-parallel-size", "2", "--threads", "1")


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


def _tp_ranks(mesh, name: str) -> list[int]:
    """The follower rank processes of a worker (the orphan guard execs into them)."""
    worker = next(p for p in mesh.workers if p.name == name)
    return _children(worker.popen.pid)


def _run(mesh, prompts, max_tokens=24):
    async def run_all():
        return await asyncio.gather(
            *(generate(mesh.gateway_address, q, max_tokens) for q in prompts)
        )

    return asyncio.run(run_all())


def _check(mesh, tiny_model):
    results = _run(mesh, PROMPTS * 2)
    want = expected(tiny_model, PROMPTS) * 2
    for (ids, text, _), (want_ids, want_text) in zip(results, want, strict=True):
        assert ids == want_ids
        assert text == want_text
    wait_until(lambda: kv_all_free(mesh), what="KV blocks to be freed everywhere")


def test_colocated_tp2_gives_the_greedy_tokens_of_tp1(tiny_model):
    mesh = start_mesh(
        tiny_model, prefill=0, decode=0, colocated=1, per_worker_args={"colocated-0": TP2}
    )
    try:
        assert len(_tp_ranks(mesh, "colocated-0")) == 1
        _check(mesh, tiny_model)
    finally:
        mesh.stop()


@pytest.mark.parametrize(
    "tps", [(2, 1), (1, 2), (2, 2)], ids=["P-tp2-D-tp1", "P-tp1-D-tp2", "P-tp2-D-tp2"]
)
def test_kv_moves_between_instances_of_different_tp_degree(tiny_model, tps):
    """Each pulled chunk carries every head (a tp=2 source gathers it from its ranks); a tp=2
    decode instance scatters each rank its heads. Tokens equal the in-process engine's, and no
    block or handle stays held on either side."""
    p, d = tps
    per_worker = {}
    if p == 2:
        per_worker["prefill-0"] = TP2
    if d == 2:
        per_worker["decode-0"] = TP2
    mesh = start_mesh(tiny_model, prefill=1, decode=1, per_worker_args=per_worker)
    try:
        _check(mesh, tiny_model)
        prefill = next(w.ready["address"] for w in mesh.workers if w.name == "prefill-0")
        decode = next(w.ready["address"] for w in mesh.workers if w.name == "decode-0")
        assert stats(prefill, "prefill").handles_released > 0
        assert stats(decode, "decode").pulls_total == 2 * len(PROMPTS)
    finally:
        mesh.stop()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("victim", ["rank0", "follower"])
def test_a_tp_group_dies_together(tiny_model, victim):
    """Kill rank 0 (even with SIGKILL): its follower ranks die with it (orphan guard). Kill a
    follower: rank 0 exits too, since the group's collectives could never complete."""
    mesh = start_mesh(
        tiny_model, prefill=0, decode=0, colocated=1, per_worker_args={"colocated-0": TP2}
    )
    try:
        worker = mesh.workers[0].popen
        (follower,) = _tp_ranks(mesh, "colocated-0")
        os.kill(worker.pid if victim == "rank0" else follower, signal.SIGKILL)
        survivor = follower if victim == "rank0" else worker.pid
        deadline = time.monotonic() + 20
        while _alive(survivor) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(survivor), f"{'follower' if victim == 'rank0' else 'rank 0'} outlived"
    finally:
        mesh.stop()
