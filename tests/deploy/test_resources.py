"""Requests and limits (distserve/deploy/resources.py): derived from the plan's model and each
pool's shape, recomputed here from the published model's numbers, and measured against a real
CPU worker."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import time

import kubernetes_validate
import pytest

from distserve.deploy.objects import GPU
from distserve.deploy.options import RenderOptions
from distserve.deploy.render import render
from distserve.role_args import RoleArgs
from services.common.errors import InvalidRequest
from tests.deploy.test_render import (
    K8S_VERSIONS,
    ROOT,
    WORKLOADS,
    args,
    container,
    deployments,
    load,
    objects,
)

GIB, MIB = 2**30, 2**20


def mib(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", quantity).groups()
    return int(number) * (1024 if unit == "Gi" else 1)


def resources(manifests, role: str) -> dict:
    return container(deployments(manifests, role)[0])["resources"]


def test_every_container_has_requests_equal_to_its_limits():
    m = render(load("plan_low_affinity.json"))
    for d in (o for o in objects(m) if o["kind"] in WORKLOADS):
        spec = d["spec"]["template"]["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            r = c["resources"]
            assert r["requests"] == r["limits"], c["name"]
            assert {"cpu", "memory"} <= r["requests"].keys(), c["name"]


def test_a_gpu_pod_asks_for_tp_gpus_and_host_memory_for_its_ranks():
    # opt-66b, prefill and decode tp=4: per rank 1 GiB process + 2 GiB CUDA host side, the
    # largest tensor (the 50272 x 9216 embedding in fp16) as the load buffer, 1 GiB /dev/shm
    m = render(load("plan_high_affinity.json"))
    expected = (4 * 3 * GIB + 50272 * 9216 * 2 + GIB) * 1.2
    expected_mib = -(-expected // (256 * MIB)) * 256
    for role in ("prefill", "decode"):
        r = resources(m, role)["requests"]
        assert r[GPU] == 4 and r["cpu"] == "16"
        assert mib(r["memory"]) == expected_mib


def test_changing_the_plan_changes_the_requests():
    plan = load("plan_high_affinity.json")
    smaller = copy.deepcopy(plan)
    for inst in smaller["placement"]["instances"]:
        if inst["role"] == "decode":
            inst["tp"] = 2
            inst["stages"][0]["gpus"] = inst["stages"][0]["gpus"][:2]
    smaller["placement"]["phases"]["decode"]["tp"] = 2
    before, after = render(plan), render(smaller)
    was, now = resources(before, "decode")["requests"], resources(after, "decode")["requests"]
    assert (was[GPU], now[GPU]) == (4, 2)
    assert (was["cpu"], now["cpu"]) == ("16", "8")
    assert mib(now["memory"]) < mib(was["memory"])
    assert resources(after, "prefill") == resources(before, "prefill")
    wider = render(plan, RenderOptions(cpus_per_rank=8))
    assert resources(wider, "decode")["requests"]["cpu"] == "32"


def test_a_model_the_gpus_cannot_hold_is_refused_at_render_time():
    # opt-175b's 350 GB of fp16 weights on tp=4 A100-80GB (0.9 usable): 288 GiB
    with pytest.raises(
        InvalidRequest, match=r"the prefill instances \(tp=4\) cannot hold opt-175b"
    ):
        render(load("plan_high_affinity.json"), RenderOptions(model_spec="opt-175b"))
    render(
        load("plan_high_affinity.json"), RenderOptions(model_spec="opt-175b", gpu_memory_gib=141)
    )
    with pytest.raises(InvalidRequest, match="give --model-spec"):
        render(load("plan_high_affinity.json"), RenderOptions(model_spec="no-such-model"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from services.engine.presets import create_model

    return create_model("tiny", tmp_path_factory.mktemp("m") / "tiny")


def cpu_render(tiny, passed: RoleArgs | None = None) -> dict:
    options = RenderOptions(device="cpu", model_spec=str(tiny), passed=passed or RoleArgs())
    return render(load("plan_low_affinity.json"), options)


def test_a_cpu_pod_holds_weights_kv_and_activations_and_states_its_kv_pool(tiny):
    from services.common.model_spec import model_spec

    spec = model_spec(tiny)
    m = cpu_render(tiny)
    d = deployments(m, "decode")[0]
    r = container(d)["resources"]["requests"]
    assert GPU not in r and "tolerations" not in d["spec"]["template"]["spec"]
    # the engine's CPU default: min(4 GiB, 64 sequences x the model's context), float32
    kv = min(4 * GIB, 64 * spec.max_context * spec.kv_bytes_per_token // spec.dtype_bytes * 4)
    assert float(args(d, m)["--kv-cache-gib"]) * GIB == pytest.approx(kv, abs=MIB)
    given = cpu_render(tiny, RoleArgs(decode=("--kv-cache-gib", "3")))
    d3 = deployments(given, "decode")[0]
    assert args(d3, given)["--kv-cache-gib"] == "3"  # the user's, not a second one
    grown = mib(container(d3)["resources"]["requests"]["memory"]) - mib(r["memory"])
    assert abs(grown - (3 * GIB - kv) * 1.2 / MIB) <= 256
    for obj in objects(m):
        kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)


def test_a_real_cpu_worker_stays_inside_the_memory_it_was_rendered(tiny):
    """Start the prefill worker with the arguments its pod gets (the rendered KV pool) on the
    tiny model; its peak resident memory must fit the pod's limit."""
    m = cpu_render(tiny)
    d = deployments(m, "prefill")[0]
    flags = args(d, m)
    limit = mib(container(d)["resources"]["limits"]["memory"]) * MIB
    worker = subprocess.Popen(
        [sys.executable, "-m", "services.prefill", "--model", str(tiny), "--port", "0",
         "--metrics-port", "-1", "--no-ucx", "--kv-cache-gib", flags["--kv-cache-gib"]],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        line = ""
        while '"ready"' not in line and time.monotonic() < deadline:
            line = worker.stdout.readline()
            assert line or worker.poll() is None, "the worker exited"
        assert '"ready"' in line
        with open(f"/proc/{worker.pid}/status") as f:
            status = f.read()
        peak = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    assert 0 < peak < limit, (peak / MIB, limit / MIB)
