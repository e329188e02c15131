"""Goodput search: bisection finds the threshold; goodput behaves as capacity should; the
estimate is the same from seed to seed within its precision."""

from __future__ import annotations

import pytest

from services.common.latency import for_model
from services.common.model_spec import PRESETS
from services.common.slo import Slo
from services.planner.cluster import ClusterSpec
from services.planner.goodput import goodput, max_rate
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


def test_unreachable_slo_has_zero_goodput():
    assert max_rate(lambda rate: 0.0, 0.9, 5.0) == 0.0


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
    """One colocated OPT-13B instance (a candidate of issue 51's example: `distserve plan
    --model-spec opt-13b --cluster 1x2 --workload prompt=fixed:512,output=fixed:64 --slo 400,40`),
    built as the planner builds it."""
    model = PRESETS["opt-13b"]
    spec = PlanSpec(
        model=model,
        cluster=ClusterSpec(1, 2),
        workload=parse_workload("prompt=fixed:512,output=fixed:64"),
        slo=Slo(0.4, 0.04),
        latency=LAT,
        colocated_latency=for_model(model, None, "vllm"),
    )
    return sim_cluster(spec, [sim_instance(spec, "colocated", 1)]), spec.workload, spec.slo


def test_ten_seeds_give_the_same_goodput_within_two_percent():
    cluster, workload, slo = issue_51_colocated()
    estimates = [
        goodput(cluster, workload, slo, 0.9, seed=s, rel_halfwidth=0.0125) for s in range(10)
    ]
    rates = [e.rate for e in estimates]
    spread = (max(rates) - min(rates)) / (sum(rates) / len(rates))
    assert spread <= 0.02, rates
    # each one's interval met the precision asked, on more requests than the search pass's
    assert all(e.rel_halfwidth <= 0.0125 and e.requests > 1000 for e in estimates)


def test_the_search_pass_alone_varies_more_than_two_percent():
    # the reason for the above: 1,000 requests' estimate moves with the seed by more than 2%
    cluster, workload, slo = issue_51_colocated()
    rates = [goodput(cluster, workload, slo, 0.9, seed=s).rate for s in range(10)]
    assert (max(rates) - min(rates)) / (sum(rates) / len(rates)) > 0.02, rates
