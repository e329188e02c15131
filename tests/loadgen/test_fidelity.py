"""The fidelity comparison's arithmetic: gap to the mean of the mesh's runs, and their spread."""

from __future__ import annotations

import pytest

from distserve.loadgen.calibration import MeshCalibration
from distserve.loadgen.fidelity import EngineParams, Fidelity, FidelityRow
from services.common.slo import Slo


def row(rate: float, predicted: float, *runs: float) -> FidelityRow:
    return FidelityRow(rate, predicted, runs, 0, 1.0, tuple({"run": i} for i in range(len(runs))))


def test_gap_is_to_the_mean_of_the_runs_and_spread_is_between_them():
    r = row(2.0, 0.30, 0.72, 0.46)
    assert r.measured == pytest.approx(0.59)
    assert r.gap_pp == pytest.approx(29.0)
    assert r.spread_pp == pytest.approx(26.0)
    assert row(1.0, 0.9, 0.88).spread_pp == 0.0


def test_json_has_every_run_and_the_largest_gap_and_spread():
    cal = MeshCalibration(0.001, 0.0, 0.01, 0.0, 0.002, 2e8, 60)
    fid = Fidelity(
        Slo(1.0, 0.02),
        cal,
        EngineParams(kv_capacity=4096, max_batch_tokens=1024, max_num_seqs=2, kv_bytes_per_token=8),
        [row(1.0, 0.9, 0.89, 0.91), row(2.0, 0.5, 0.40, 0.70)],
    )
    out = fid.to_json()
    assert [r["measured_runs"] for r in out["rows"]] == [[0.89, 0.91], [0.4, 0.7]]
    assert [len(r["runs"]) for r in out["rows"]] == [2, 2]
    assert out["max_gap_pp"] == pytest.approx(5.0)
    assert out["max_spread_pp"] == pytest.approx(30.0)
