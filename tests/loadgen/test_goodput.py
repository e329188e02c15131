"""Goodput on the real mesh (tiny model): the bisection over the rate, the SLO rule, explicit
SLOs, and `distserve bench goodput`'s outputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from distserve.loadgen import GrpcTarget
from distserve.loadgen import goodput as g
from distserve.loadgen.cli import main
from distserve.loadgen.comparison import BenchSpec, mesh_spec
from services.common.model_config import ModelConfig
from services.common.slo import Slo
from services.planner.workload import LengthDist, Workload

# Long prompts (two fit a 2048-token prefill batch): a burst of them queues for prefill, so
# TTFT rises well past a few times the unloaded one at high rates.
WORKLOAD = Workload(
    "long", LengthDist("uniform", low=700, high=900), LengthDist("uniform", low=8, high=16)
)


def fake_probe(rate: float, attainment: float) -> g.Probe:
    empty = np.zeros(0)
    pct = {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    return g.Probe(rate, attainment, pct, pct, pct, 0, 0.0, 0.0, empty, empty)


def test_search_brackets_the_knee_within_the_probe_budget():
    calls = []

    def at(rate: float) -> g.Probe:
        calls.append(rate)
        return fake_probe(rate, 1.0 if rate <= 3.3 else 0.5)

    s = g.search_goodput(at, alpha=0.9, rate_lo=1.0, rate_hi=4.0, max_probes=8, rel_tol=0.05)
    assert len(calls) <= 8 and calls[0] == pytest.approx(2.0)  # geometric middle first
    assert 3.3 * 0.95 <= s.goodput <= 3.3
    assert any(p.rate > s.goodput and p.attainment < 0.9 for p in s.probes)
    # Nothing passes: the search goes below the range, and goodput is 0.
    s = g.search_goodput(lambda r: fake_probe(r, 0.0), rate_lo=1.0, rate_hi=4.0, max_probes=3)
    assert [p.rate for p in s.probes] == pytest.approx([2.0, 1.0, 0.5]) and s.goodput == 0.0


def test_step_search_walks_up_from_a_low_hint_then_halves_between_a_pass_and_a_fail():
    knee = 10.0
    rates = []

    def measure(rate: float) -> g.Probe:
        rates.append(rate)
        return fake_probe(rate, 0.95 if rate <= knee else 0.5)

    search = g.step_search(measure, start=9.0, probes=6, alpha=0.9)
    assert len(search.probes) == 6
    assert rates[0] == pytest.approx(0.97 * 9.0)
    assert rates[1] == pytest.approx(rates[0] * 1.04)  # every probe passed: up by a step
    failing = min(r for r in rates if r > knee)
    assert knee - (failing - search.goodput) <= search.goodput <= knee
    before = rates[:-1]  # the last probe: halfway between the best pass and the least fail
    top = max(r for r in before if r <= knee)
    assert rates[-1] == pytest.approx((top + min(r for r in before if r > knee)) / 2)


def test_step_search_walks_down_from_a_high_hint_until_a_probe_passes():
    search = g.step_search(lambda r: fake_probe(r, 0.95 if r <= 5.0 else 0.2), 10.0, 20, 0.9)
    assert 5.0 * 0.96 <= search.goodput <= 5.0


def test_bisection_on_the_mesh_finds_a_passing_rate_below_a_failing_one(shared_mesh, tiny_model):
    mesh = shared_mesh  # 1P1D
    vocab = ModelConfig.from_dir(tiny_model).vocab_size
    target = GrpcTarget(mesh.gateway_address)
    base = WORKLOAD.sample(20, seed=4)
    alone = g.unloaded(target, base, vocab)
    assert alone.prompt_tokens == int(np.median(base.prompt)) and alone.ttft_s > 0
    slo = g.slo_from_unloaded(alone)
    assert slo.ttft_s == pytest.approx(g.TTFT_SLO_FACTOR * alone.ttft_s)
    assert slo.tpot_s == pytest.approx(g.TPOT_SLO_FACTOR * alone.tpot_s)
    # Judged by 2.5x the unloaded TTFT: a burst of 20 long prompts (5,000 req/s) must fail it.
    # The range starts at 2 req/s, where the requests (~0.1 s each) hardly overlap: at 10 the
    # 2-core host's other work sometimes made more than a tenth miss, and nothing passed.
    slo = Slo(slo.ttft_s / 2, slo.tpot_s)
    s = g.search_goodput(
        lambda r: g.measure(target, base, r, slo, vocab),
        alpha=0.9,
        rate_lo=2.0,
        rate_hi=5000.0,
        max_probes=5,
    )
    assert len(s.probes) <= 5
    good = s.at(s.goodput)
    assert good is not None and good.attainment >= 0.9 and good.errors == 0, s.to_json()
    assert any(p.rate > s.goodput and p.attainment < 0.9 for p in s.probes), s.to_json()
    # An explicit SLO nothing can meet: attainment 0 at the rate that passed.
    assert g.measure(target, base, s.goodput, Slo(1e-6, 1e-6), vocab).attainment == 0.0


def test_bench_goodput_writes_json_and_plots_and_honours_an_explicit_slo(tiny_model, tmp_path):
    out = tmp_path / "out"
    argv = ["bench", "goodput", "--model", str(tiny_model), "--mode", "both"]
    argv += ["--workload", "prompt=uniform:16:64,output=uniform:4:8", "--requests", "6"]
    argv += ["--max-probes", "2", "--rates", "20,40", "--slo", "100000,100000"]
    argv += ["--out", str(out), "--no-progress"]
    assert main(argv) == 0
    report = json.loads((out / "goodput.json").read_text())
    assert report["slo"] == {"ttft_ms": 100000.0, "tpot_ms": 100000.0}
    assert report["slo_rule"] == "explicit"
    for mode in ("disaggregated", "colocated"):
        m = report["modes"][mode]
        # Both probes (the geometric middle, then the range's top) meet the loose SLO.
        assert [p["rate_rps"] for p in m["probes"]] == pytest.approx([28.2843, 40.0])
        assert all(p["attainment"] == 1.0 for p in m["probes"])
        assert m["goodput_rps"] == 40.0 and m["goodput_per_core_rps"] == 20.0
    assert report["ratio_per_core"] == 1.0
    assert report["equal_load"]["rate_rps"] == 40.0
    for mode in ("disaggregated", "colocated"):
        at = report["equal_load"][mode]
        assert len(at["ttft_ms"]) == len(at["tpot_ms"]) == 6 and None not in at["ttft_ms"]
    for png in ("attainment.png", "latency_cdf.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mesh_shapes_come_from_the_options(tiny_model, capsys):
    """--prefill/--decode/--colocated size the two meshes (a 2P1D comparison on 3+ cores)."""
    spec = BenchSpec(model=tiny_model, prefill=2, decode=1, colocated=3)
    d, c = mesh_spec(spec, "disaggregated"), mesh_spec(spec, "colocated")
    assert (d.prefill, d.decode, d.colocated) == (2, 1, 0)
    assert (c.prefill, c.decode, c.colocated) == (0, 0, 3)
    assert d.pin and c.pin
    default = BenchSpec(model=tiny_model)
    assert (mesh_spec(default, "disaggregated").prefill, default.colocated) == (1, 2)
    assert main(["bench", "goodput", "--model", str(tiny_model), "--decode", "0"]) == 2
    assert "--decode" in capsys.readouterr().err


def test_workload_names_arrivals_and_text_traces(tiny_model, tmp_path):
    assert g.resolve_workload("summarization") is g.SCALED["summarization"]
    assert g.resolve_workload("chat", "gamma:2").cv == 2.0
    with pytest.raises(Exception, match="gamma:CV"):
        g.parse_arrivals("gamma:x")
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"arrival_s": 0.0, "prompt": "hello there mesh", "output_tokens": 4}\n'
        '{"arrival_s": 0.5, "prompt_tokens": 32, "output_tokens": 8}\n'
    )
    w = g.resolve_workload(f"trace:{trace}", tokenizer_dir=tiny_model)
    assert w.prompt[0] >= 1 and w.prompt[1] == 32 and w.output.tolist() == [4, 8]
