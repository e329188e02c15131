"""Goodput search: bisection finds the threshold; goodput behaves as capacity should; the
estimate is the same from seed to seed within its precision."""

from __future__ import annotations

import pytest

from services.common.latency import for_model
from services.common.model_spec import PRESETS
from services.common.slo import Slo
from services.planner.cluster import ClusterSpec
from services.planner.goodput import bracket, goodput, max_rate, refine
from services.planner.placement import PlanSpec, sim_cluster, sim_instance
from services.planner.simulator import Instance, SimCluster
from services.planner.workload import LengthDist, Workload, parse_workload

LAT = for_model(PRESETS["opt-13b"], None)
CODE = Workload(
    "code", LengthDist("lognormal", 170, 80, 8, 1024), LengthDist("lognormal", 100, 60, 1, 512)
)


@pytest.mark.parametrize("hint", [0.01, 7.0, 900.0])
def test_bisection_finds_the_threshold_from_any_hint(hint):
    threshold = 12.3
    calls = []

    def attainment(rate: float) -> float:
        calls.append(rate)
        return 1.0 if rate <= threshold else 0.5

    found = max_rate(attainment, 0.9, hint, rel_tol=0.01)
    assert threshold * 0.99 <= found <= threshold
    assert len(calls) < 30


def test_unreachable_slo_has_zero_goodput_in_few_probes():
    calls = []

    def never(rate: float) -> float:
        calls.append(rate)
        return 0.0

    assert max_rate(never, 0.9, 5.0) == 0.0
    assert len(calls) <= 5  # three halvings, then the floor at once


def test_a_smooth_attainment_curve_is_bracketed_by_aiming_at_the_crossing():
    # attainment falls linearly from 1 at rate 5 to 0 at rate 15: it crosses 0.9 at 6.
    calls = []

    def attainment(rate: float) -> float:
        calls.append(rate)
        return min(1.0, max(0.0, 1 - (rate - 5) / 10))

    lo, hi = bracket(attainment, 0.9, 9.0, rel_tol=0.02)
    assert lo <= 6.0 < hi and hi - lo <= 0.02 * hi
    assert len(calls) <= 6  # bisection from [4.5, 9] to 2% takes 7 probes after the first two


def disaggregated(n_prefill: int, n_decode: int) -> SimCluster:
    return SimCluster(
        (Instance("prefill", max_batch_tokens=1024),) * n_prefill
        + (Instance("decode", kv_capacity=66144),) * n_decode,
        LAT,
    )


def test_goodput_grows_with_instances_and_with_slack_in_the_slo():
    slo = Slo(0.25, 0.05)
    one = goodput(disaggregated(1, 1), CODE, slo, 0.9).rate
    two = goodput(disaggregated(2, 2), CODE, slo, 0.9).rate
    loose = goodput(disaggregated(1, 1), CODE, Slo(0.5, 0.1), 0.9).rate
    assert one > 0
    assert two >= 1.8 * one
    assert loose > one


def test_goodput_is_where_attainment_crosses_alpha():
    from services.planner.simulator import simulate

    slo = Slo(0.25, 0.05)
    cluster = disaggregated(1, 1)
    estimate = goodput(cluster, CODE, slo, 0.9, min_requests=2000)
    rate = estimate.rate
    assert estimate.low < rate < estimate.high and estimate.requests == 2000
    requests = CODE.sample(2000, 0)
    # interpolated inside a 2% bracket whose lower end meets alpha
    at = simulate(cluster, requests.at_rate(rate * 0.98), 1500).attainment(slo, 500)
    above = simulate(cluster, requests.at_rate(rate * 1.1), 1500).attainment(slo, 500)
    assert at >= 0.9 > above


def issue_51_colocated() -> tuple[SimCluster, Workload, Slo]:
    """The colocated baseline of issue 51's example (`distserve plan --model-spec opt-13b
    --cluster 1x2 --workload prompt=fixed:512,output=fixed:64 --slo 400,40`): two colocated
    OPT-13B instances, built as the planner builds them."""
    model = PRESETS["opt-13b"]
    spec = PlanSpec(
        model=model,
        cluster=ClusterSpec(1, 2),
        workload=parse_workload("prompt=fixed:512,output=fixed:64"),
        slo=Slo(0.4, 0.04),
        latency=LAT,
        colocated_latency=for_model(model, None, "vllm"),
    )
    instances = [sim_instance(spec, "colocated", 1)] * 2
    return sim_cluster(spec, instances), spec.workload, spec.slo


def test_ten_seeds_give_the_same_refined_goodput_within_two_percent():
    cluster, workload, slo = issue_51_colocated()
    quick = [goodput(cluster, workload, slo, 0.9, min_requests=2000, seed=s) for s in range(10)]
    refined = [
        refine(cluster, workload, slo, 0.9, q, precision=0.01, budget=2_000_000, seed=s)
        for s, q in enumerate(quick)
    ]
    rates = [e.rate for e in refined]
    assert spread(rates) <= 0.02, rates
    # each one's interval met the precision asked, on more requests than the quick estimate's
    assert all(e.rel_halfwidth <= 0.01 and e.requests > 2000 for e in refined)
    # and the quick estimates alone do not: the reason for refining
    assert spread([q.rate for q in quick]) > 0.02


def test_a_refinement_without_budget_is_the_quick_estimate():
    cluster, workload, slo = issue_51_colocated()
    quick = goodput(cluster, workload, slo, 0.9, min_requests=2000)
    assert refine(cluster, workload, slo, 0.9, quick, precision=0.01, budget=0) == quick
    assert quick.low < quick.rate < quick.high and quick.rel_halfwidth > 0.01


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / (sum(values) / len(values))
