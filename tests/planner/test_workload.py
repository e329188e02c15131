"""Workloads: arrival processes, length distributions, presets and trace files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from services.common.errors import InvalidRequest
from services.planner.workload import PRESETS, LengthDist, TraceWorkload, Workload, parse_workload


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_arrivals_have_unit_rate_and_the_asked_burstiness(cv):
    w = Workload(
        "x", LengthDist("fixed", 10, low=10, high=10), LengthDist("fixed", 1, low=1, high=1), cv
    )
    gaps = np.diff(w.sample(200_000, 0).arrival_s)
    assert gaps.mean() == pytest.approx(1.0, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_at_rate_rescales_time_only():
    r = PRESETS["chat"].sample(1000, 3)
    fast = r.at_rate(4.0)
    assert fast.arrival_s == pytest.approx(r.arrival_s / 4)
    assert (fast.prompt == r.prompt).all() and (fast.output == r.output).all()


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_stay_in_their_clips_near_their_means(name):
    w = PRESETS[name]
    r = w.sample(50_000, 0)
    assert r.prompt.min() >= w.prompt.low and r.prompt.max() <= w.prompt.high
    assert r.output.min() >= w.output.low and r.output.max() <= w.output.high
    # clipping moves the mean a little, not a lot
    assert r.prompt.mean() == pytest.approx(w.prompt.mean, rel=0.15)


def test_length_specs_parse():
    assert LengthDist.parse("fixed:512").sample(np.random.default_rng(0), 3).tolist() == [512] * 3
    u = LengthDist.parse("uniform:10:20").sample(np.random.default_rng(0), 1000)
    assert u.min() >= 10 and u.max() <= 20
    n = LengthDist.parse("normal:100:10:90:110")
    assert (n.low, n.high) == (90, 110)
    with pytest.raises(InvalidRequest, match="expected fixed:N"):
        LengthDist.parse("zipf:2")


def test_workload_specs_parse():
    assert parse_workload("code").name == "code"
    bursty = parse_workload("chat:cv=2")
    assert bursty.cv == 2 and bursty.prompt == PRESETS["chat"].prompt
    custom = parse_workload("prompt=fixed:256,output=uniform:1:64,cv=1.5")
    assert custom.prompt.mean == 256 and custom.output.high == 64 and custom.cv == 1.5
    with pytest.raises(InvalidRequest, match="give a preset"):
        parse_workload("nonsense")


def test_trace_replays_rescaled_and_repeated(tmp_path):
    path = tmp_path / "trace.jsonl"
    rows = [{"arrival_s": t, "prompt_tokens": 100 + t, "output_tokens": 5} for t in range(10)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    trace = parse_workload(f"trace:{path}")
    assert isinstance(trace, TraceWorkload)
    r = trace.sample(25)
    assert len(r) == 25
    assert np.diff(r.arrival_s).mean() == pytest.approx(1.0, rel=0.05)  # unit rate
    assert r.prompt[:10].tolist() == [100 + t for t in range(10)]
    assert r.prompt[10:20].tolist() == r.prompt[:10].tolist()
    assert trace.max_tokens == 114


def test_bad_traces_are_clear_errors(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 5}\n')
    with pytest.raises(InvalidRequest, match="request 1"):
        TraceWorkload.load(path)
    path.write_text(
        '{"arrival_s": 1, "prompt_tokens": 5, "output_tokens": 1}\n'
        '{"arrival_s": 0, "prompt_tokens": 5, "output_tokens": 1}\n'
    )
    with pytest.raises(InvalidRequest, match="must not decrease"):
        TraceWorkload.load(path)
