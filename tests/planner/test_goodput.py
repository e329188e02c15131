"""Goodput search: bisection finds the threshold; goodput behaves as capacity should."""

from __future__ import annotations

import pytest

from services.common.latency import for_model
from services.common.model_spec import PRESETS
from services.common.slo import Slo
from services.planner.goodput import goodput, max_rate
from services.planner.simulator import Instance, SimCluster
from services.planner.workload import LengthDist, Workload

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
    one = goodput(disaggregated(1, 1), CODE, slo, 0.9)
    two = goodput(disaggregated(2, 2), CODE, slo, 0.9)
    loose = goodput(disaggregated(1, 1), CODE, Slo(0.5, 0.1), 0.9)
    assert one > 0
    assert two >= 1.8 * one
    assert loose > one


def test_goodput_is_where_attainment_crosses_alpha():
    from services.planner.simulator import simulate

    slo = Slo(0.25, 0.05)
    cluster = disaggregated(1, 1)
    rate = goodput(cluster, CODE, slo, 0.9, min_requests=2000)
    requests = CODE.sample(2000, 0)
    at = simulate(cluster, requests.at_rate(rate), 1500).attainment(slo, 500)
    above = simulate(cluster, requests.at_rate(rate * 1.1), 1500).attainment(slo, 500)
    assert at >= 0.9 > above
