"""The planner's decisions on a running mesh (services/planner/autoscale.py), on OPT-13B's
published A100 profile: up when the SLO is at risk, down only when it stays safe, never back and
forth under a constant load, nothing while a change is in flight, never over the budget; a role
re-sharded only when allowed, when it does better, and when `transition` (transition.py) can
make it without leaving a role with no instance (OPT-66B)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from distserve.loadgen.emulated import EmulatedCluster
from services.common.errors import InvalidRequest
from services.common.slo import Slo
from services.planner.autoscale import AutoscaleConfig, Autoscaler, _replay, _scaled
from services.planner.decision import View
from services.planner.drift import Arrival, Sample
from services.planner.placement import PlanSpec, sim_cluster
from services.planner.simulator import simulate
from services.planner.workload import PRESETS

SLO = Slo(0.25, 0.1)  # chat, DistServe's Table 1
BUDGET = 8
NOW = 1000.0


@pytest.fixture(scope="module")
def autoscaler() -> Autoscaler:
    cluster = EmulatedCluster.of("opt-13b")
    spec = cluster.plan_spec(BUDGET, PRESETS["chat"], SLO)
    return Autoscaler(spec, {"prefill": 1, "decode": 1}, AutoscaleConfig(budget=BUDGET))


def served(
    a: Autoscaler,
    counts,
    workload: str,
    rate: float,
    seed: int,
    n: int = 240,
    end: float = NOW,
    mesh: PlanSpec | None = None,
    tp: dict | None = None,
):
    """`n` requests of a workload at `rate`, as the mesh of `counts` instances (of tensor
    degree `tp`, default the autoscaler's) would report them (the simulator's TTFT and TPOT;
    `mesh`: the step times it runs at, default the planner's), the last arriving just before
    `end`."""
    tp = tp or {}
    requests = PRESETS[workload].sample(n, seed).at_rate(rate)
    instances = [a._instance(r, tp.get(r, a.tp[r])) for r in a.roles for _ in range(counts[r])]
    result = simulate(sim_cluster(mesh or a.spec, instances), requests)
    start = end - requests.arrival_s[-1] - 0.01
    return tuple(
        Sample(start + t, int(p), int(o), ttft * 1000, tpot * 1000)
        for t, p, o, ttft, tpot in zip(
            requests.arrival_s,
            requests.prompt,
            requests.output,
            result.ttft,
            result.tpot,
            strict=True,
        )
    )


def settled(a: Autoscaler, workload: str, rate: float, counts=None, seed: int = 0) -> dict:
    """Decide until the decisions hold: the counts the planner settles on for a load."""
    counts = dict(counts or {"prefill": 1, "decode": 1})
    for _ in range(6):
        d = a.decide(View(NOW, served(a, counts, workload, rate, seed), counts))
        if d.action != "scale":
            return counts
        assert a.devices(d.counts) <= BUDGET
        counts = d.counts
    raise AssertionError(f"no settled placement: still scaling at {counts}")


def test_a_load_the_mesh_cannot_meet_scales_it_up_within_the_budget(autoscaler):
    counts = {"prefill": 1, "decode": 1}
    d = autoscaler.decide(View(NOW, served(autoscaler, counts, "chat", 6.0, 0), counts))
    assert d.action == "scale", d
    assert autoscaler.devices(d.counts) > 2 and autoscaler.devices(d.counts) <= BUDGET
    assert d.observed < 0.9 and d.predicted["target"] >= 0.9 > d.predicted["current"]
    assert d.to_json()["counts"] == d.counts


def test_a_constant_load_makes_no_change_once_placed(autoscaler):
    counts = settled(autoscaler, "chat", 6.0)
    for seed in range(1, 9):  # other windows of the same load: its noise
        samples = served(autoscaler, counts, "chat", 6.0, seed)
        d = autoscaler.decide(View(NOW, samples, counts))
        assert d.action == "hold", (seed, d)


def deciding(a: Autoscaler, counts, rates: list[float]) -> list:
    """Decisions every 10 s up to NOW on a placement that landed before the stabilisation
    period, each on a window of chat at the next of `rates`."""
    stab = a.config.down_stabilization_s
    times = NOW - stab + 10.0 * np.arange(len(rates))
    return [
        a.decide(
            View(t, served(a, counts, "chat", r, 0, end=t), counts, last_change_s=NOW - stab - 40)
        )
        for t, r in zip(times, rates, strict=True)
    ]


def test_a_load_that_falls_scales_down_only_to_what_stays_safe(autoscaler):
    """Down is slow: the smaller placement must have been safe at every decision over the
    stabilisation period (on this placement) first; it is then predicted safe at 1.5x."""
    counts = settled(autoscaler, "chat", 6.0)
    ticks = int(autoscaler.config.down_stabilization_s / 10) + 1
    *early, d = deciding(autoscaler, counts, [1.5] * ticks)
    assert all(e.action == "hold" for e in early), early
    assert d.action == "scale" and autoscaler.devices(d.counts) < autoscaler.devices(counts)
    rate, requests = _replay(
        [s for s in served(autoscaler, counts, "chat", 1.5, 0)], autoscaler.config.replay
    )
    headroom = autoscaler.config.down_headroom
    assert autoscaler.predict(d.counts, requests.at_rate(rate * headroom)) >= 0.9


def test_one_window_of_the_old_load_inside_the_stabilisation_period_keeps_the_placement(
    autoscaler,
):
    """The load fell, but one decision in the period still saw it as it was (a noisy window):
    nothing smaller was safe then, so the mesh keeps its size (no 2 -> 1 -> 2)."""
    counts = settled(autoscaler, "chat", 6.0)
    ticks = int(autoscaler.config.down_stabilization_s / 10) + 1
    rates = [1.5] * ticks
    rates[ticks // 2] = 6.0
    decisions = deciding(autoscaler, counts, rates)
    assert all(d.action == "hold" for d in decisions), decisions


def test_nothing_is_decided_while_a_change_is_in_flight_or_cooling_down(autoscaler):
    counts = {"prefill": 1, "decode": 1}
    samples = served(autoscaler, counts, "chat", 6.0, 0)
    assert autoscaler.decide(View(NOW, samples, counts, in_flight=True)).action == "wait"
    cooling = View(NOW, samples, counts, last_change_s=NOW - 10)
    assert autoscaler.decide(cooling).action == "hold"
    assert autoscaler.decide(dataclasses.replace(cooling, last_change_s=NOW - 31)).action == "scale"


def test_a_load_past_the_budget_gets_the_best_the_budget_allows(autoscaler):
    counts = {"prefill": 4, "decode": 4}
    d = autoscaler.decide(View(NOW, served(autoscaler, counts, "chat", 200.0, 0), counts))
    assert d.action in ("scale", "hold")
    assert autoscaler.devices(d.counts) <= BUDGET


def test_a_workload_of_longer_prompts_moves_devices_to_prefill(autoscaler):
    chat = settled(autoscaler, "chat", 3.0)
    long_prompts = settled(autoscaler, "summarization", 3.0, counts=chat)
    share = lambda c: c["prefill"] / (c["prefill"] + c["decode"])  # noqa: E731
    assert share(long_prompts) > share(chat), (chat, long_prompts)


def test_few_requests_decide_nothing_and_bad_configs_are_refused(autoscaler):
    counts = {"prefill": 1, "decode": 1}
    few = served(autoscaler, counts, "chat", 6.0, 0, n=10)
    assert autoscaler.decide(View(NOW, few, counts)).action == "hold"
    big = {"prefill": 2, "decode": 2}
    recent = View(NOW, few, big, last_change_s=NOW - 30)
    assert autoscaler.decide(recent).action == "hold"  # the window is not all since the change
    idle = autoscaler.decide(dataclasses.replace(recent, last_change_s=NOW - 61))
    assert (idle.action, idle.counts) == ("scale", counts)
    with pytest.raises(InvalidRequest, match="up < down"):
        AutoscaleConfig(budget=8, up_headroom=1.5, down_headroom=1.2)
    with pytest.raises(InvalidRequest, match="budget"):
        AutoscaleConfig(budget=0)
    with pytest.raises(InvalidRequest, match="down-stabilization"):
        AutoscaleConfig(budget=8, down_stabilization_s=-1)


def test_samples_in_the_order_requests_finished_measure_the_same_rate(autoscaler):
    """The gateway reports a request when it finishes: a long one that arrived first comes
    late. The measured rate and decision are those of the samples in arrival order (they were
    not: the window's span was read from its first and last samples as they came)."""
    counts = {"prefill": 1, "decode": 1}
    samples = served(autoscaler, counts, "chat", 3.0, 0)
    finished = sorted(
        samples, key=lambda s: s.arrival_s + s.ttft_ms / 1000 + s.tpot_ms / 1000 * s.output_tokens
    )
    assert list(finished) != list(samples)
    in_order = autoscaler.decide(View(NOW, samples, counts))
    as_finished = autoscaler.decide(View(NOW, tuple(finished), counts))
    assert as_finished.rate == pytest.approx(in_order.rate)
    assert (as_finished.action, as_finished.counts) == (in_order.action, in_order.counts)


def slower_mesh(a: Autoscaler, prefill: float, decode: float) -> PlanSpec:
    """The spec of a mesh whose steps take `prefill` / `decode` times the profile's."""
    return dataclasses.replace(
        a.spec,
        latency=_scaled(a.spec.latency, prefill, decode),
        colocated_latency=_scaled(a.spec.colocated_latency, prefill, decode),
    )


def test_the_latency_model_is_corrected_toward_what_the_mesh_measures_clamped_and_smoothed():
    cluster = EmulatedCluster.of("opt-13b")
    spec = cluster.plan_spec(BUDGET, PRESETS["chat"], SLO)
    a = Autoscaler(spec, {"prefill": 1, "decode": 1}, AutoscaleConfig(budget=BUDGET))
    counts = {"prefill": 2, "decode": 2}
    requests = PRESETS["chat"].sample(240, 0).at_rate(2.0)

    def window(mesh: PlanSpec) -> tuple[Sample, ...]:
        return served(a, counts, "chat", 2.0, 0, mesh=mesh)

    slow = window(slower_mesh(a, 1.5, 1.5))
    before = a.predict(counts, requests)
    first = a.decide(View(NOW, slow, counts))
    # one window moves it by correction_weight of the way, no further
    assert 1.0 < first.correction["decode"] < 1.5 * 0.3 + 0.7 + 0.05, first.correction
    assert first.to_json()["latency_correction"] == {
        k: round(v, 4) for k, v in first.correction.items()
    }
    for _ in range(12):
        last = a.decide(View(NOW, slow, counts))
    assert last.correction["decode"] == pytest.approx(1.5, rel=0.1), last.correction
    assert last.correction["prefill"] > 1.2, last.correction
    assert a.predict(counts, requests.at_rate(3.0)) <= before  # slower steps: no better
    # a mesh 5x slower than the profile: the correction stops at its bound
    slowest = window(slower_mesh(a, 5.0, 5.0))
    for _ in range(20):
        d = a.decide(View(NOW, slowest, counts))
    assert max(d.correction.values()) <= a.config.correction_bounds[1]


def test_a_surge_of_arrivals_is_seen_at_once_and_poisson_noise_never_looks_like_one(autoscaler):
    """The arrival rate the planner decides on (the gateway reports arrivals as they come):
    over 30 minutes of Poisson arrivals at a constant rate, no tick (every 5 s) sees a surge; a
    tripled rate is one within a tick of its start and is measured at its own rate."""
    rng = np.random.default_rng(7)
    rate, tick = 6.0, 5.0
    arrivals = np.cumsum(rng.exponential(1 / rate, int(rate * 1900)))
    window = autoscaler.config.window_s
    for now in np.arange(60.0, 1800.0, tick):
        seen = tuple(Arrival(t, 500) for t in arrivals[arrivals <= now])
        view = View(now, (), {}, arrivals=seen, arrivals_since_s=0.0)
        measured, surge = autoscaler._arrival_rate(view, 0.0)
        assert surge == "", (now, surge)
        assert abs(measured - rate) < 4 * np.sqrt(rate * window) / window, (now, measured)
    burst = 1800.0 + np.cumsum(rng.exponential(1 / (3 * rate), int(3 * rate * tick)))
    before = arrivals[arrivals <= 1800.0]
    now = 1800.0 + tick
    both = np.concatenate([before, burst[burst <= now]])
    measured, surge = autoscaler._arrival_rate(
        View(now, (), {}, arrivals=tuple(Arrival(t, 500) for t in both), arrivals_since_s=0.0), 0.0
    )
    assert surge and 2 * rate < measured < 4 * rate, (measured, surge)
    # No arrivals reported (an older gateway): the finished requests' rate stands
    assert autoscaler._arrival_rate(View(now, (), {}), 4.2) == (4.2, "")


@pytest.fixture(scope="module")
def code_66b() -> PlanSpec:
    """OPT-66B on A100s, code's prompts and a TTFT SLO of 90 ms: a prompt's prefill at tp 2
    takes about that long alone, so more tp-2 prefill instances cannot meet it; tp 4 can."""
    return EmulatedCluster.of("opt-66b").plan_spec(BUDGET, PRESETS["code"], Slo(0.09, 0.2))


def test_a_role_too_slow_at_its_degree_is_resharded_when_allowed(code_66b):
    tp = {"prefill": 2, "decode": 2}
    counts = {"prefill": 1, "decode": 1}
    keep = Autoscaler(code_66b, tp, AutoscaleConfig(budget=BUDGET))
    d = keep.decide(View(NOW, served(keep, counts, "code", 1.0, 0), counts))
    assert d.action == "hold" and d.tp == tp, d  # more tp-2 instances do no better
    reshard = Autoscaler(code_66b, tp, AutoscaleConfig(budget=BUDGET, tp_choices=(1, 2, 4, 8)))
    assert reshard.degrees("prefill", 2) == [2, 4, 8]  # tp 1 holds no OPT-66B
    d = reshard.decide(View(NOW, served(reshard, counts, "code", 1.0, 0), counts))
    assert d.action == "scale" and d.tp == {"prefill": 4, "decode": 2}, d
    assert d.counts == counts and d.predicted["target"] >= 0.9 > d.predicted["current"]
    assert d.to_json()["tp"] == d.tp
    # once re-sharded, the view says so: the placement holds
    d = reshard.decide(View(NOW, served(reshard, counts, "code", 1.0, 1, tp=d.tp), counts, tp=d.tp))
    assert d.action == "hold" and d.tp == {"prefill": 4, "decode": 2}, d


def test_a_reshard_that_would_leave_a_role_without_an_instance_is_not_taken(code_66b):
    """Budget 6 on 1P(tp2)1D(tp2): a tp-4 prefill instance has no room beside the tp-2 one,
    and that is prefill's only instance: the actuator could only drain it first (no prefill
    meanwhile), so the planner does not ask."""
    tp = {"prefill": 2, "decode": 2}
    counts = {"prefill": 1, "decode": 1}
    a = Autoscaler(code_66b, tp, AutoscaleConfig(budget=6, tp_choices=(2, 4)))
    d = a.decide(View(NOW, served(a, counts, "code", 1.0, 0), counts))
    assert d.tp == tp, d


def test_at_equal_devices_the_mesh_keeps_its_degrees():
    """Chat on OPT-13B: the re-sharding planner takes what the one that keeps degrees takes
    (a re-shard replaces every instance of a role: only worth it where it does better)."""
    spec = EmulatedCluster.of("opt-13b").plan_spec(BUDGET, PRESETS["chat"], SLO)
    tp = {"prefill": 1, "decode": 1}
    keep = Autoscaler(spec, tp, AutoscaleConfig(budget=BUDGET))
    reshard = Autoscaler(spec, tp, AutoscaleConfig(budget=BUDGET, tp_choices=(1, 2, 4)))
    samples = served(keep, tp, "chat", 6.0, 0)
    a, b = (x.decide(View(NOW, samples, tp)) for x in (reshard, keep))
    assert b.action == "scale" and b.tp == tp, b
    assert (a.action, a.counts, a.tp) == (b.action, b.counts, b.tp)
