"""The gateway's workload feed against a real planner process: samples (arrivals and finished
requests) arrive in windows, a drift makes the planner recommend a new placement, and a missing
planner never blocks."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from services.common.gen.distserve.v1 import planner_pb2, planner_pb2_grpc
from services.gateway.planner_feed import PlannerFeed

WINDOW = 40


@pytest.fixture(scope="module")
def planner_address():
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "services.planner", "--port", "0", "--workers", "4",
            "--num-requests", "200", "--drift-window", str(WINDOW), "--drift-confirm", "1",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        ready = json.loads(proc.stdout.readline())
        with grpc.insecure_channel(ready["address"]) as channel:
            planner_pb2_grpc.PlannerStub(channel).Plan(
                planner_pb2.PlanRequest(
                    model_spec="opt-13b",
                    workload="prompt=fixed:200,output=fixed:100",
                    ttft_slo_ms=400,
                    tpot_slo_ms=100,
                ),
                timeout=120,
            )
        yield ready["address"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def placement(address: str) -> planner_pb2.Placement:
    with grpc.insecure_channel(address) as channel:
        return planner_pb2_grpc.PlannerStub(channel).GetPlacement(
            planner_pb2.GetPlacementRequest(), timeout=10
        )


async def feed_phases(address: str, registry: CollectorRegistry) -> PlannerFeed:
    """Steady short prompts for three windows, then much longer ones for three."""
    feed = PlannerFeed(address, registry, stream_samples=WINDOW, stream_s=5)
    feed.start()
    rng = np.random.default_rng(0)
    t = 1000.0
    for prompt in [200] * (3 * WINDOW) + [2000] * (3 * WINDOW):
        t += rng.exponential(0.1)
        feed.arrived(t, prompt)  # as the gateway does: at once, and again when it finishes
        feed.add(t, prompt, 100, ttft_s=0.05, tpot_s=0.03)
    deadline = time.monotonic() + 60
    sent = lambda: registry.get_sample_value("distserve_planner_samples_total", {"outcome": "sent"})  # noqa: E731
    while (sent() or 0) < 12 * WINDOW and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(1.0)  # the last stream's reply
    await feed.stop()
    return feed


def test_a_drift_in_the_reported_workload_gets_a_new_placement(planner_address):
    before = placement(planner_address)
    assert before.algorithm == "single-host" and before.version == 1
    registry = CollectorRegistry()
    asyncio.run(feed_phases(planner_address, registry))
    assert registry.get_sample_value("distserve_planner_samples_total", {"outcome": "sent"}) == (
        12 * WINDOW
    )
    after = placement(planner_address)
    assert after.version > before.version
    assert after.reason.startswith("drift:") and "prompt" in after.reason
    roles = {p.role: p.replicas for p in after.phases}
    assert sum(roles.values()) == 4  # still the host's four workers, split anew
    version = registry.get_sample_value("distserve_planner_placement_version")
    assert version == after.version


def test_an_unreachable_planner_drops_samples_and_never_blocks():
    registry = CollectorRegistry()

    async def scenario():
        feed = PlannerFeed("127.0.0.1:1", registry, capacity=10)
        feed.start()
        t = time.monotonic()
        for i in range(100):
            feed.add(float(i), 10, 10, 0.01, 0.01)
        elapsed = time.monotonic() - t
        await asyncio.sleep(0.2)
        await feed.stop()
        return elapsed

    assert asyncio.run(scenario()) < 0.1
    dropped = registry.get_sample_value("distserve_planner_samples_total", {"outcome": "dropped"})
    assert dropped >= 89  # 10 queued (and one taken by the stream that cannot connect)
