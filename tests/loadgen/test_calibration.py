"""The fidelity harness's calibration arithmetic: `under_load` recovers how much slower each phase
ran, and `mesh_latency` applies it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from distserve.loadgen.calibration import MeshCalibration, mesh_latency, under_load
from distserve.loadgen.results import LoadResult
from services.common.latency import Coefficients, LatencyModel, TpLatency
from services.planner.simulator import SimResult, simulate_1p1d
from services.planner.workload import Requests

# Prefill 0.2 ms per prompt token; decode 5 ms per step plus 1 ms per sequence in it.
LATENCY = LatencyModel(
    "plain",
    {1: TpLatency(Coefficients(0, 0.2, 0), Coefficients(5, 0, 1), Coefficients(5, 0, 1))},
    "test",
    stage_overhead_ms=0.0,
)
SEATS = 2
CAL = MeshCalibration(
    decode_step_extra_s=0.0,
    decode_seq_extra_s=0.0,
    ttft_hops_s=0.01,
    layerwise_prefill_s=0.0,
    handoff_s=0.0,
    bandwidth=1e12,
    requests=0,
)


def predict(cal: MeshCalibration, burst: Requests) -> SimResult:
    """As `fidelity.predict`: the simulator on the calibrated model, hops added to TTFT."""
    sim = simulate_1p1d(
        mesh_latency(LATENCY, cal),
        burst,
        kv_bytes_per_token=1,
        kv_capacity=10**6,
        max_batch_tokens=1024,
        max_num_seqs=SEATS,
        bandwidth=cal.bandwidth,
    )
    return SimResult(sim.ttft + cal.ttft_hops_s, sim.tpot)


def test_under_load_recovers_each_phase_slow_down():
    """A 'mesh' that runs prefill 1.5x and decode 1.2x slower than the model: its TTFTs are the
    simulator's with prefill scaled, and every token gap of a request the model's full-batch
    step, scaled. `under_load` finds both factors, and the scaled model predicts its TTFTs."""
    rng = np.random.default_rng(0)
    n = 24
    burst = Requests(np.zeros(n), rng.integers(64, 768, n), rng.integers(32, 160, n))
    slow = replace(CAL, prefill_scale=1.5, decode_scale=1.2)
    truth = predict(slow, burst)
    step = mesh_latency(LATENCY, slow).at(1)
    gaps = tuple(
        np.array([step.decode_ms(SEATS, SEATS * (p + k)) / 1000 for k in range(1, o)])
        for p, o in zip(burst.prompt.tolist(), burst.output.tolist(), strict=True)
    )
    nan = np.full(n, np.nan)
    measured = LoadResult(
        target="test",
        arrival_s=burst.arrival_s,
        sent_s=burst.arrival_s,
        ttft_s=truth.ttft,
        tpot_s=truth.tpot,
        latency_s=nan,
        prompt_tokens=burst.prompt,
        expected_tokens=burst.output,
        output_tokens=burst.output,
        error=(None,) * n,
        error_message=("",) * n,
        token_gaps_s=gaps,
        duration_s=1.0,
    )
    found = under_load(CAL, LATENCY, burst, measured, lambda c: predict(c, burst), SEATS)
    assert found.prefill_scale == pytest.approx(1.5, rel=1e-3)
    assert found.decode_scale == pytest.approx(1.2, rel=2e-2)
    assert predict(found, burst).ttft == pytest.approx(truth.ttft, rel=1e-3)
