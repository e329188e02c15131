"""The simulator against queueing theory and against the latency model it is built on."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import InvalidRequest
from services.common.latency import Coefficients, LatencyModel, TpLatency, for_model
from services.common.model_spec import PRESETS
from services.common.slo import Slo
from services.planner.simulator import Instance, SimCluster, simulate, simulate_1p1d
from services.planner.workload import LengthDist, Requests, Workload

OPT13 = PRESETS["opt-13b"]
LAT = for_model(OPT13, None)


def fixed(prompt: int, output: int, cv: float = 1.0) -> Workload:
    return Workload(
        "fixed",
        LengthDist("fixed", prompt, low=prompt, high=prompt),
        LengthDist("fixed", output, low=output, high=output),
        cv,
    )


def one_request(prompt: int, output: int) -> Requests:
    return Requests(np.array([0.0]), np.array([prompt]), np.array([output]))


@pytest.mark.parametrize("utilisation", [0.3, 0.6, 0.9])
def test_unbatched_prefill_queue_is_md1(utilisation):
    """Constant prompts, one instance, no batching: mean TTFT = D + R D^2 / (2 (1 - R D))."""
    d = (LAT.prefill_stage_ms(1, 1, 512, 512**2) + LAT.iteration_ms(512)) / 1000
    rate = utilisation / d
    cluster = SimCluster((Instance("prefill", max_batch_size=1), Instance("decode")), LAT)
    # A queue at 0.9 forgets its past slowly (the standard error of a 400k-request run's mean
    # wait is about 2%): 3M requests there, in six runs, each conditioned on its realised
    # arrival rate being R (at 0.9 a 0.2% rate error moves the mean wait by 2%).
    runs, n = (6, 500_000) if utilisation > 0.8 else (2, 100_000)
    means = []
    for seed in range(runs):
        requests = fixed(512, 1).sample(n, seed)
        exact = requests.at_rate(rate * requests.arrival_s[-1] / n)
        means.append(simulate(cluster, exact).ttft.mean())
    expected = d + rate * d * d / (2 * (1 - rate * d))
    assert np.mean(means) == pytest.approx(expected, rel=0.02)


def test_batching_up_to_lm_cuts_queueing():
    d = LAT.prefill_stage_ms(1, 1, 128, 128**2) / 1000
    requests = fixed(128, 1).sample(20_000, 0).at_rate(0.9 / d)
    unbatched = Instance("prefill", max_batch_size=1)
    batched = Instance("prefill", max_batch_tokens=1024)
    ttft = [
        simulate(SimCluster((inst, Instance("decode")), LAT), requests).ttft.mean()
        for inst in (unbatched, batched)
    ]
    assert ttft[1] < 0.5 * ttft[0]


def test_a_lone_request_takes_the_model_times():
    """TTFT is one prefill, TPOT the mean of its decode steps (context growing by one each)."""
    prompt, output = 300, 20
    cluster = SimCluster(
        (Instance("prefill"), Instance("decode")),
        LAT,
        kv_bytes_per_token=OPT13.kv_bytes_per_token,
        intra_node_bandwidth=100e9,
    )
    result = simulate(cluster, one_request(prompt, output))
    ttft = (LAT.prefill_stage_ms(1, 1, prompt, prompt**2) + LAT.iteration_ms(prompt)) / 1000
    transfer = prompt * OPT13.kv_bytes_per_token / 100e9
    contexts = [prompt + 1 + k for k in range(output - 1)]
    steps = sum(LAT.at(1).decode_ms(1, c) + LAT.iteration_ms(c) for c in contexts) / 1000
    assert result.ttft[0] == pytest.approx(ttft)
    assert result.tpot[0] == pytest.approx((transfer + steps) / (output - 1))


def test_kv_transfer_over_a_slow_link_shows_in_tpot():
    requests = fixed(1024, 16).sample(200, 0).at_rate(0.2)  # the link never queues

    def tpot(bandwidth: float) -> float:
        cluster = SimCluster(
            (Instance("prefill", nodes=(0,)), Instance("decode", nodes=(1,))),
            LAT,
            kv_bytes_per_token=OPT13.kv_bytes_per_token,
            inter_node_bandwidth=bandwidth,
        )
        return float(np.median(simulate(cluster, requests).tpot))

    slow, fast = tpot(2e9), tpot(200e9)
    # 1024 tokens x 0.8 MB = 839 MB: 0.42 s at 2 GB/s, spread over 15 tokens
    assert slow - fast == pytest.approx(
        1024 * OPT13.kv_bytes_per_token * (1 / 2e9 - 1 / 200e9) / 15, rel=0.05
    )


# Prefill 1 ms per prompt token, decode 10 ms per step, no stage overhead: times by hand.
PLAIN = LatencyModel(
    "plain",
    {1: TpLatency(Coefficients(0, 1, 0), Coefficients(10, 0, 0), Coefficients(10, 0, 0))},
    "test",
    stage_overhead_ms=0.0,
)


def test_handoff_time_comes_before_the_second_token():
    cluster = SimCluster((Instance("prefill"), Instance("decode")), PLAIN, handoff_s=0.05)
    result = simulate(cluster, one_request(100, 11))
    assert result.ttft[0] == pytest.approx(0.1)
    assert result.tpot[0] == pytest.approx((0.05 + 10 * 0.01) / 10)


def test_layerwise_handoff_holds_a_decode_seat_from_the_prefill_start():
    """One decode seat; a 300-token prompt (prefill 0.3 s) and a 100-token one (0.1 s) arrive
    together on two prefill instances. Handed off after prefill, the short one takes the seat at
    0.1 s; handed off when its prefill starts, the long one holds it from 0 to 0.31 s and the
    short one waits for it."""
    requests = Requests(np.zeros(2), np.array([300, 100]), np.array([2, 2]))
    instances = (Instance("prefill"), Instance("prefill"), Instance("decode", max_num_seqs=1))
    late = simulate(SimCluster(instances, PLAIN), requests)
    layerwise = simulate(SimCluster(instances, PLAIN, layerwise_min_tokens=256), requests)
    assert late.ttft == pytest.approx([0.3, 0.1]) and layerwise.ttft == pytest.approx([0.3, 0.1])
    assert late.tpot == pytest.approx([0.01, 0.01])
    assert layerwise.tpot == pytest.approx([0.01, 0.22])


def test_layerwise_handoff_hides_the_transfer_behind_the_prefill():
    # 1 MB of KV per token at 1 GB/s: 1 ms per prompt token, as long as the prefill
    requests = one_request(300, 11)

    def tpot(least: int | None) -> float:
        cluster = SimCluster(
            (Instance("prefill"), Instance("decode")),
            PLAIN,
            kv_bytes_per_token=2**20,
            intra_node_bandwidth=2**30,
            layerwise_min_tokens=least,
        )
        return float(simulate(cluster, requests).tpot[0])

    transfer = 300 * 2**20 / 2**30
    assert tpot(None) == pytest.approx((transfer + 0.1) / 10)
    assert tpot(256) == pytest.approx((max(0.0, transfer - 0.3) + 0.1) / 10)


def test_serving_a_pull_beside_the_prefill_lengthens_the_prefill():
    requests = Requests(np.array([0.0, 0.0]), np.array([300, 100]), np.array([2, 2]))
    cluster = SimCluster(
        (Instance("prefill", max_batch_size=1), Instance("decode")),
        PLAIN,
        layerwise_min_tokens=256,
        layerwise_prefill_s=0.02,
    )
    # the long prompt's prefill takes 0.02 s more, and the short one queues behind it
    assert simulate(cluster, requests).ttft == pytest.approx([0.32, 0.42])


def test_decode_admits_only_what_fits_its_memory():
    # room for two requests of 600 tokens: the third waits for one to leave
    requests = Requests(np.zeros(3), np.full(3, 500), np.full(3, 100))
    cluster = SimCluster((Instance("decode", kv_capacity=1200),), LAT)
    result = simulate(cluster, requests)
    assert result.tpot[2] > 1.9 * result.tpot[0]
    with pytest.raises(InvalidRequest, match="fits no instance"):
        simulate(cluster, Requests(np.zeros(1), np.array([1500]), np.array([10])))


def test_colocated_prefill_stalls_decoding():
    """The interference disaggregation removes: the same load on a colocated instance has a
    worse TPOT than on a decode instance fed by a prefill instance."""
    requests = fixed(1024, 64).sample(2000, 0).at_rate(3.0)
    disaggregated = SimCluster((Instance("prefill"), Instance("decode")), LAT)
    colocated = SimCluster((Instance("colocated"),), LAT)
    tpot_d = np.median(simulate(disaggregated, requests).tpot)
    tpot_c = np.median(simulate(colocated, requests).tpot)
    assert tpot_c > 1.5 * tpot_d


def test_pipeline_lanes_multiply_decode_throughput():
    requests = fixed(256, 128).sample(3000, 0).at_rate(40.0)
    slo = Slo(10.0, 0.06)
    one = simulate(SimCluster((Instance("decode", pp=1, max_num_seqs=16),), LAT), requests)
    two = simulate(SimCluster((Instance("decode", pp=2, max_num_seqs=32),), LAT), requests)
    assert two.attainment(slo) > one.attainment(slo)


def test_until_stops_once_the_first_requests_finish():
    requests = fixed(256, 32).sample(1000, 0).at_rate(5.0)
    cluster = SimCluster((Instance("prefill"), Instance("decode")), LAT)
    part = simulate(cluster, requests, until=500)
    whole = simulate(cluster, requests)
    assert len(part) == 500
    # the first 500 see the same cluster either way (FCFS: later arrivals do not overtake them)
    assert part.ttft == pytest.approx(whole.ttft[:500])


def test_joint_attainment_needs_both_slos():
    requests = fixed(512, 64).sample(500, 0).at_rate(4.0)
    result = simulate(SimCluster((Instance("prefill"), Instance("decode")), LAT), requests)
    ttft_ok = np.mean(result.ttft <= 0.1)
    tpot_ok = np.mean(result.tpot <= 0.022)
    both = result.attainment(Slo(0.1, 0.022))
    assert both <= min(ttft_ok, tpot_ok)
    assert both == pytest.approx(np.mean((result.ttft <= 0.1) & (result.tpot <= 0.022)))


def test_simulate_1p1d_is_one_prefill_and_one_decode():
    requests = fixed(128, 16).sample(300, 0).at_rate(2.0)
    result = simulate_1p1d(
        LAT,
        requests,
        kv_bytes_per_token=OPT13.kv_bytes_per_token,
        kv_capacity=66144,
        max_batch_tokens=1024,
        max_num_seqs=64,
        bandwidth=10e9,
    )
    assert len(result) == 300 and np.all(result.ttft > 0) and np.all(result.tpot > 0)


def test_simulator_speed_is_in_the_tens_of_thousands_per_second():
    """A correctness-minded floor (the benchmark measures the real figure)."""
    import time

    requests = (
        Workload(
            "chat",
            LengthDist("lognormal", 750, 600, 4, 1536),
            LengthDist("lognormal", 200, 200, 1, 512),
        )
        .sample(20_000, 0)
        .at_rate(3.0)
    )
    cluster = SimCluster(
        (Instance("prefill", max_batch_tokens=1024), Instance("decode", kv_capacity=66144)), LAT
    )
    start = time.perf_counter()
    simulate(cluster, requests)
    assert 20_000 / (time.perf_counter() - start) > 10_000
