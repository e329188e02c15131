"""The planner service over a real socket: Plan, GetPlacement, ReportWorkload with drift, errors;
and the single-host split it recommends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from services.common.gen.distserve.v1 import planner_pb2, planner_pb2_grpc
from services.common.latency import for_model
from services.common.model_spec import PRESETS
from services.common.slo import Slo
from services.planner.cluster import ClusterSpec
from services.planner.placement import PlanSpec, split_workers
from services.planner.workload import parse_workload

WINDOW = 50


@pytest.fixture(scope="module")
def planner(tmp_path_factory):
    """The planner's stub; `.ready` is its ready line, `.trace_file` where its spans go."""
    trace_file = tmp_path_factory.mktemp("planner") / "spans.jsonl"
    env = {**os.environ, "DISTSERVE_TRACE_FILE": str(trace_file), "OTEL_BSP_SCHEDULE_DELAY": "50"}
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "services.planner", "--port", "0", "--cluster", "1x4",
            "--num-requests", "200", "--precision", "0", "--drift-window", str(WINDOW),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )  # fmt: skip
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready" and ready["service"] == "planner"
        with grpc.insecure_channel(ready["address"]) as channel:
            stub = planner_pb2_grpc.PlannerStub(channel)
            stub.ready, stub.trace_file = ready, trace_file
            yield stub
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def samples(rate: float, n: int, start: float, seed: int):
    rng = np.random.default_rng(seed)
    t = start
    for _ in range(n):
        t += rng.exponential(1 / rate)
        yield planner_pb2.WorkloadSample(
            arrival_unix_s=t, prompt_tokens=170, output_tokens=100, ttft_ms=50, tpot_ms=30
        )


def test_plan_report_drift_and_replan(planner):
    with pytest.raises(grpc.RpcError) as e:
        planner.GetPlacement(planner_pb2.GetPlacementRequest())
    assert e.value.code() == grpc.StatusCode.NOT_FOUND

    request = planner_pb2.PlanRequest(
        model_spec="opt-13b", workload="code", ttft_slo_ms=250, tpot_slo_ms=100, rate=5
    )
    trace_id = "ab" * 16
    traceparent = f"00-{trace_id}-00f067aa0ba902b7-01"
    reply = planner.Plan(request, timeout=120, metadata=(("traceparent", traceparent),))
    assert reply.placement.version == 1 and reply.placement.reason == "plan"
    assert reply.placement.num_gpus <= 4 and reply.ratio_over_colocated > 0
    assert {p.role for p in reply.placement.phases} == {"prefill", "decode"}
    assert json.loads(reply.plan_json)["placement"]["algorithm"] == reply.placement.algorithm
    assert planner.GetPlacement(planner_pb2.GetPlacementRequest()).version == 1

    # steady at 5 req/s: the reference, then quiet
    quiet = planner.ReportWorkload(samples(5, 4 * WINDOW, 0.0, 1), timeout=60)
    assert (quiet.samples, quiet.drifts, quiet.placement.version) == (4 * WINDOW, 0, 1)

    # the rate triples and stays: one drift, one replan at the new rate
    shifted = planner.ReportWorkload(samples(15, 4 * WINDOW, 1000.0, 2), timeout=120)
    assert shifted.drifts == 1 and shifted.reasons[0].startswith("rate")
    assert shifted.placement.version == 2
    assert shifted.placement.reason.startswith("drift: rate")
    assert planner.GetPlacement(planner_pb2.GetPlacementRequest()).version == 2

    # What it was told and what it decided, on its Prometheus endpoint ...
    from tests.test_observability import scrape, value

    m = scrape(planner.ready["metrics_address"])
    assert value(m, "distserve_planner_workload_samples_total") == 8 * WINDOW
    assert value(m, "distserve_planner_drifts_total") == 1
    assert value(m, "distserve_planner_placements_total", reason="plan") == 1
    assert value(m, "distserve_planner_placements_total", reason="drift") == 1
    assert value(m, "distserve_planner_search_seconds_count") == 2
    assert value(m, "distserve_planner_placement_version") == 2
    assert value(m, "distserve_planner_goodput_per_device_rps") == pytest.approx(
        shifted.placement.goodput_per_gpu_rps
    )
    roles = [i.role for i in shifted.placement.instances]
    for role in ("prefill", "decode"):
        assert value(m, "distserve_planner_instances", role=role) == roles.count(role)
    # ... and in its trace: the Plan call's search joins the caller's trace.
    deadline = time.monotonic() + 10
    while True:
        lines = planner.trace_file.read_text().splitlines() if planner.trace_file.exists() else []
        spans = {s["name"]: s for s in map(json.loads, lines)}
        if {"planner.plan", "planner.replan"} <= set(spans):
            break
        assert time.monotonic() < deadline, f"planner spans never came: {sorted(spans)}"
        time.sleep(0.05)
    plan_span, replan = spans["planner.plan"], spans["planner.replan"]
    assert (plan_span["trace_id"], plan_span["parent_span_id"]) == (trace_id, "00f067aa0ba902b7")
    assert plan_span["service"] == "distserve-planner"
    assert plan_span["attributes"]["planner.version"] == 1
    assert plan_span["attributes"]["planner.algorithm"] == reply.placement.algorithm
    assert replan["attributes"]["planner.version"] == 2
    assert replan["attributes"]["planner.drift"] == shifted.reasons[0]


def test_bad_requests_get_invalid_argument(planner):
    with pytest.raises(grpc.RpcError) as e:
        planner.Plan(planner_pb2.PlanRequest(model_spec="gpt-9", ttft_slo_ms=1, tpot_slo_ms=1))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown model" in e.value.details()
    bad = [planner_pb2.WorkloadSample(arrival_unix_s=1.0, prompt_tokens=0, output_tokens=5)]
    with pytest.raises(grpc.RpcError) as e:
        planner.ReportWorkload(iter(bad))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    arrival = [planner_pb2.WorkloadSample(arrival_unix_s=1.0, prompt_tokens=0, arrival=True)]
    with pytest.raises(grpc.RpcError) as e:
        planner.ReportWorkload(iter(arrival))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_tokens >= 1" in e.value.details()


def split_for(workload: str) -> tuple[int, int]:
    model = PRESETS["opt-13b"]
    spec = PlanSpec(
        model=model,
        cluster=ClusterSpec(1, 6),
        workload=parse_workload(workload),
        slo=Slo(0.4, 0.05),
        latency=for_model(model, None),
        colocated_latency=for_model(model, None, "vllm"),
        num_requests=300,
    )
    placement = split_workers(spec, 6)
    n_p, n_d = placement.phase("prefill").replicas, placement.phase("decode").replicas
    assert n_p + n_d == 6 and placement.algorithm == "single-host"
    return n_p, n_d


def test_single_host_split_follows_the_workload():
    long_prompts = split_for("prompt=fixed:1500,output=fixed:20")
    long_outputs = split_for("prompt=fixed:100,output=fixed:400")
    assert long_prompts[0] > long_outputs[0]  # more prefill workers for prefill-heavy work


def test_a_plan_request_reads_files_only_under_plan_files(tiny_model, tmp_path):
    """A model folder or trace named by a Plan request is read only under --plan-files: without
    it every path is refused by name, with it those under it are read and others refused (a
    `..` or a link leading out included)."""
    import shutil

    from services.common.errors import InvalidRequest
    from services.planner.config import PlannerConfig
    from services.planner.servicer import plan_spec

    def request(model: str, workload: str = "chat") -> planner_pb2.PlanRequest:
        return planner_pb2.PlanRequest(
            model_spec=model, workload=workload, ttft_slo_ms=400, tpot_slo_ms=40
        )

    root = tmp_path / "plans"
    (root / "tiny").mkdir(parents=True)
    shutil.copy(tiny_model / "config.json", root / "tiny")
    (root / "link").symlink_to(tiny_model)  # inside, leading out
    none, inside = PlannerConfig(), PlannerConfig(plan_files=root)
    for bad in (request(str(root / "tiny")), request("opt-13b", "trace:/etc/hostname")):
        with pytest.raises(InvalidRequest, match="--plan-files DIR, and this planner has none"):
            plan_spec(bad, none)
    assert plan_spec(request("facebook/OPT-13B"), none).model == PRESETS["opt-13b"]
    assert plan_spec(request(str(root / "tiny")), inside).model.num_layers > 0
    for outside in (
        request(str(root / "link")),
        request(f"{root}/tiny/../../{tiny_model}"),
        request(str(tiny_model)),
        request("opt-13b", "trace:/etc/hostname"),
    ):
        with pytest.raises(InvalidRequest, match=f"is read only under --plan-files {root}"):
            plan_spec(outside, inside)
