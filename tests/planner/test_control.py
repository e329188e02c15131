"""The planner's control loop (services/planner/control.py) on a fake clock and a fake actuator:
a burst is decided on at the first tick after it starts (a surge of arrivals, before most of its
requests finished), and while a change is being applied every tick waits and nothing is asked
of the actuator; a change that lands is told to the decider with the way it went."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from distserve.loadgen.emulated import EmulatedCluster
from services.common import clock
from services.common.slo import Slo
from services.planner.actuator import ActuatorStatus, Instance
from services.planner.autoscale import AutoscaleConfig, Autoscaler
from services.planner.control import ControlLoop
from services.planner.drift import Sample
from services.planner.placement import sim_cluster
from services.planner.simulator import simulate
from services.planner.workload import PRESETS, Requests

SLO = Slo(0.25, 0.1)  # chat, DistServe's Table 1
RATE = 3.8  # chat on OPT-13B: 1P1D meets the SLO (bench/planner/autoplan.py's R)
BURST_AT, BURST_S = 120.0, 60.0
TICK_S = 5.0
APPLY_S = 20.0  # how long the fake actuator takes to apply a change


class FakeActuator:
    """Applies a change `apply_s` seconds (on the fake clock) after it is asked."""

    def __init__(self, now, counts: dict[str, int], apply_s: float) -> None:
        self.now, self.counts, self.apply_s = now, dict(counts), apply_s
        self.asked: list[tuple[float, dict[str, int], bool]] = []  # (when, counts, in flight)
        self._pending: tuple[float, dict[str, int]] | None = None
        self.changes = 0

    def _land(self) -> None:
        if self._pending and self.now() >= self._pending[0]:
            self.counts, self._pending = self._pending[1], None

    def status(self) -> ActuatorStatus:
        self._land()
        instances = tuple(
            Instance(f"{role}-{i}", role, "serving")
            for role, n in self.counts.items()
            for i in range(n)
        )
        return ActuatorStatus(instances, changing=self._pending is not None, changes=self.changes)

    def apply(self, pool: str, counts, reason: str = "", tp=None) -> None:
        self._land()
        self.asked.append((self.now(), dict(counts), self._pending is not None))
        self.changes += 1
        self._pending = (self.now() + self.apply_s, dict(counts))


@pytest.fixture(scope="module")
def autoscaler() -> Autoscaler:
    cluster = EmulatedCluster.of("opt-13b")
    spec = cluster.plan_spec(8, PRESETS["chat"], SLO)
    return Autoscaler(spec, {"prefill": 1, "decode": 1}, AutoscaleConfig(budget=8))


def burst_samples(a: Autoscaler) -> list[Sample]:
    """Chat at RATE, then 3 x RATE from BURST_AT for BURST_S, as 1P1D serves it (the
    simulator's TTFT and TPOT), in arrival order."""
    steady = PRESETS["chat"].sample(int(RATE * (BURST_AT + BURST_S)) + 50, 0).at_rate(RATE)
    burst = PRESETS["chat"].sample(int(3 * RATE * BURST_S) + 50, 1).at_rate(3 * RATE)
    keep = steady.arrival_s < BURST_AT + BURST_S
    inside = burst.arrival_s < BURST_S
    t = np.concatenate([steady.arrival_s[keep], BURST_AT + burst.arrival_s[inside]])
    order = np.argsort(t, kind="stable")
    prompt = np.concatenate([steady.prompt[keep], burst.prompt[inside]])[order]
    output = np.concatenate([steady.output[keep], burst.output[inside]])[order]
    requests = Requests(t[order], prompt, output)
    instances = [a._instance("prefill", 1), a._instance("decode", 1)]
    served = simulate(sim_cluster(a.spec, instances), requests)
    return [
        Sample(float(t), int(p), int(o), ttft * 1000, tpot * 1000)
        for t, p, o, ttft, tpot in zip(
            requests.arrival_s, prompt, output, served.ttft, served.tpot, strict=True
        )
    ]


def test_a_burst_is_decided_within_a_tick_and_no_decision_is_taken_while_one_is_applied(
    autoscaler, monkeypatch
):
    """The feed reports each request twice, as the gateway does: when it arrives, and when it
    finishes (at arrival + TTFT + TPOT x the rest, as 1P1D serves it). The burst is decided on
    at the first tick after it starts, as a surge of arrivals (its requests have mostly not
    finished yet)."""
    now = [0.0]
    monkeypatch.setattr(clock, "time_s", lambda: now[0])
    actuator = FakeActuator(lambda: now[0], {"prefill": 1, "decode": 1}, APPLY_S)
    loop = ControlLoop(autoscaler, actuator, CollectorRegistry(), interval_s=TICK_S)
    samples = burst_samples(autoscaler)
    finishing = sorted(samples, key=ends)
    decisions = []
    arrived = finished = 0
    for tick in range(1, int((BURST_AT + BURST_S) / TICK_S) + 1):
        now[0] = tick * TICK_S
        while arrived < len(samples) and samples[arrived].arrival_s <= now[0]:
            loop.arrived(samples[arrived].arrival_s, samples[arrived].prompt_tokens)
            arrived += 1
        while finished < len(finishing) and ends(finishing[finished]) <= now[0]:
            loop.observe(finishing[finished])
            finished += 1
        changing = actuator.status().changing
        decision = asyncio.run(loop.tick())
        decisions.append((now[0], changing, decision))
    before = [d for t, _, d in decisions if t < BURST_AT and d.action == "scale"]
    assert not before, before  # the steady load needs no change
    first = min(t for t, _, d in decisions if d.action == "scale")
    assert first - BURST_AT <= TICK_S, [(t, d.action, d.reason) for t, _, d in decisions]
    in_flight = [(t, d.action) for t, changing, d in decisions if changing]
    assert in_flight and all(action == "wait" for _, action in in_flight), in_flight
    assert actuator.asked and not any(busy for _, _, busy in actuator.asked), actuator.asked
    assert all(autoscaler.devices(counts) <= 8 for _, counts, _ in actuator.asked)
    assert not math.isnan(decisions[-1][2].rate)
    first_burst = next(d for t, _, d in decisions if t > BURST_AT)
    assert first_burst.action == "scale" and "surge" in first_burst.reason, first_burst


def ends(s: Sample) -> float:
    """When a request finishes: arrival + TTFT + TPOT for each token after the first."""
    return s.arrival_s + (s.ttft_ms + s.tpot_ms * (s.output_tokens - 1)) / 1000


def test_a_surge_is_decided_on_between_ticks_as_its_arrivals_come(autoscaler, monkeypatch):
    """With ticks too far apart to matter, the loop decides on a burst as soon as its arrivals
    show a surge: within 5 s of its start (a tripled rate at 3.8 req/s: ~2.5 s median,
    bench/planner/surge.py), a change asked of the actuator, and nothing decided before the
    burst."""
    now = [0.0]
    monkeypatch.setattr(clock, "time_s", lambda: now[0])
    actuator = FakeActuator(lambda: now[0], {"prefill": 1, "decode": 1}, APPLY_S)
    loop = ControlLoop(autoscaler, actuator, CollectorRegistry(), interval_s=1e6)
    samples = burst_samples(autoscaler)
    finishing = sorted(samples, key=ends)

    async def feed() -> None:
        task = asyncio.create_task(loop.run())
        finished = 0
        for s in samples:
            now[0] = s.arrival_s  # the clock stands still while a woken tick runs
            while finished < len(finishing) and ends(finishing[finished]) <= now[0]:
                loop.observe(finishing[finished])
                finished += 1
            loop.arrived(s.arrival_s, s.prompt_tokens)
            if loop._wake.is_set():
                for _ in range(2000):
                    await asyncio.sleep(0.005)
                    if loop.latest is not None and (
                        loop.latest.action != "scale" or actuator.asked
                    ):
                        break
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(feed())
    decision = loop.latest
    assert decision is not None, "no surge woke the loop"
    assert BURST_AT <= loop.latest_at_s <= BURST_AT + 5.0, loop.latest_at_s
    assert decision.action == "scale" and "surge" in decision.reason, decision
    assert [counts for _, counts, _ in actuator.asked] == [decision.counts]


def test_a_change_that_lands_is_told_to_the_decider_with_the_way_it_went(autoscaler, monkeypatch):
    """The loop tells the autoscaler when the last change landed and which way it went (from
    the placement before it), which is what its cool-down holds or lets through: up, then
    down, then a reshape, each as its own actuator change."""
    now = [0.0]
    monkeypatch.setattr(clock, "time_s", lambda: now[0])
    actuator = FakeActuator(lambda: now[0], {"prefill": 1, "decode": 1}, APPLY_S)
    loop = ControlLoop(autoscaler, actuator, CollectorRegistry(), interval_s=TICK_S)
    asyncio.run(loop.tick())
    assert loop._latest_view.last_change == ""  # the start
    for counts, way in (
        ({"prefill": 3, "decode": 1}, "up"),
        ({"prefill": 2, "decode": 1}, "down"),
        ({"prefill": 1, "decode": 2}, "reshape"),
    ):
        actuator.apply("default", counts)
        now[0] += TICK_S
        assert asyncio.run(loop.tick()).action == "wait"
        now[0] += APPLY_S
        asyncio.run(loop.tick())
        view = loop._latest_view
        assert (view.last_change, view.last_change_s, dict(view.counts)) == (way, now[0], counts)
