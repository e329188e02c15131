"""The latency model: published profiles load as published, fits recover what generated the
data, scaling and our own profile format behave."""

from __future__ import annotations

import json

import numpy as np
import pytest

from services.common import latency
from services.common.errors import InvalidRequest
from services.common.model_spec import PRESETS


def test_published_profile_loads_as_published():
    model = latency.for_model(PRESETS["opt-13b"], None)
    assert sorted(model.by_tp) == [1, 2, 4]
    tp1 = model.at(1)
    assert tp1.prefill.to_list() == pytest.approx(
        [18.10254647486372, 0.1019122572698738, 7.122264314252114e-06]
    )
    # 512-token prompt: 18.10 + 0.1019 * 512 + 7.12e-6 * 512^2
    assert tp1.prefill_ms(512, 512**2) == pytest.approx(18.1025 + 52.1791 + 1.8671, rel=1e-4)
    # decode switches coefficient sets at the threshold (95)
    assert tp1.decode_ms(94, 1000) == pytest.approx(19.9347 + 0.6269 + 0.03851 * 94, rel=1e-3)
    assert tp1.decode_ms(95, 1000) == pytest.approx(7.16619 + 0.57980 + 0.15831 * 95, rel=1e-3)


def test_published_fits_carry_distserve_simulators_per_iteration_overhead():
    """simdistserve adds 2 ms + 0.0001 ms per token to every iteration on top of these fits (its
    `add_ray_overhead`): the fits time the model alone. Scaled models and the vLLM fit keep it;
    the emulated runner, whose loop is real, can drop it."""
    for model in (
        latency.for_model(PRESETS["opt-13b"], None),
        latency.for_model(PRESETS["opt-175b"], None),
        latency.for_model(PRESETS["opt-13b"], None, "vllm"),
    ):
        assert model.iteration_ms(0) == 2.0
        assert model.iteration_ms(10_000) == pytest.approx(3.0)
        assert model.without_iteration_overhead().iteration_ms(10_000) == 0.0


def test_pipeline_stage_divides_the_work_and_adds_a_hop():
    model = latency.for_model(PRESETS["opt-66b"], None)
    whole = model.at(2).prefill_ms(1024, 1024**2)
    assert model.prefill_stage_ms(2, 4, 1024, 1024**2) == pytest.approx(whole / 4 + 1.0)


def test_vllm_profile_is_the_colocated_engines():
    ours = latency.for_model(PRESETS["opt-13b"], None)
    vllm = latency.for_model(PRESETS["opt-13b"], latency.PUBLISHED["distserve"], engine="vllm")
    assert vllm.source.endswith("vllm.json")
    assert vllm.at(1).prefill.a != ours.at(1).prefill.a


def test_saturation_tokens_follow_the_ten_percent_rule():
    model = latency.for_model(PRESETS["opt-13b"], None)
    t = model.saturation_tokens(1)
    p = model.at(1).prefill

    def throughput(n: int) -> float:
        return n / (p.a + p.b * n)

    assert throughput(2 * t) < 1.1 * throughput(t)
    assert throughput(t) >= 1.1 * throughput(t // 2)


def test_unknown_tensor_degree_is_a_clear_error():
    model = latency.for_model(PRESETS["opt-13b"], None)
    with pytest.raises(InvalidRequest, match="no tp=8"):
        model.at(8)


def test_opt_175b_is_scaled_from_66b_and_is_slower_at_every_degree():
    big = latency.for_model(PRESETS["opt-175b"], None)
    base = latency.for_model(PRESETS["opt-66b"], None)
    assert "scaled from facebook/opt-66b" in big.source
    assert sorted(big.by_tp) == [1, 2, 3, 4, 6, 8]  # 96 heads: every degree up to a node
    for tp in base.by_tp:
        assert big.at(tp).prefill_ms(512, 512**2) > base.at(tp).prefill_ms(512, 512**2)
        assert big.at(tp).decode_ms(16, 16 * 600) > base.at(tp).decode_ms(16, 16 * 600)
    # filled degrees sit where more tensor parallelism is faster
    ms = [big.at(tp).prefill_ms(2048, 2048**2) for tp in (1, 2, 4, 6, 8)]
    assert ms == sorted(ms, reverse=True)
    for tp in big.by_tp:
        assert min(big.at(tp).prefill.to_list() + big.at(tp).decode_small.to_list()) >= 0


def test_fit_recovers_the_coefficients_that_made_the_data():
    rng = np.random.default_rng(0)
    batches = [list(rng.integers(16, 1024, rng.integers(1, 6))) for _ in range(60)]
    truth = latency.Coefficients(5.0, 0.05, 2e-5)
    ms = [truth.ms(sum(b), sum(x * x for x in b)) * (1 + rng.normal(0, 0.01)) for b in batches]
    fitted, error = latency.fit_prefill(batches, ms)
    assert fitted.a == pytest.approx(5.0, rel=0.05)
    assert fitted.b == pytest.approx(0.05, rel=0.05)
    assert fitted.c == pytest.approx(2e-5, rel=0.15)
    assert error.mean_rel < 0.02 and error.samples == 60


def test_fit_keeps_coefficients_non_negative():
    # data with no quadratic part and noise that would push an unconstrained c below zero
    batches = [[n] for n in (16, 64, 256, 1024, 2048)]
    ms = [3 + 0.01 * n - 1e-7 * n * n for n in (16, 64, 256, 1024, 2048)]
    fitted, _ = latency.fit_prefill(batches, ms)
    assert min(fitted.to_list()) >= 0


def test_decode_fit_finds_the_two_regimes():
    small, large = latency.Coefficients(10, 0.001, 0.05), latency.Coefficients(4, 0.001, 0.12)
    batch, ctx, ms = [], [], []
    for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
        for c in (128, 512, 1024):
            coeffs = small if b < 64 else large
            batch.append(b)
            ctx.append(b * c)
            ms.append(coeffs.ms(b * c, b))
    fitted, error = latency.fit_decode(batch, ctx, ms)
    assert fitted.threshold == 64
    assert error.max_rel < 1e-6
    assert fitted.decode_small.c == pytest.approx(0.05, rel=1e-4)
    assert fitted.decode_large.c == pytest.approx(0.12, rel=1e-4)


def test_our_profile_format_round_trips(tmp_path):
    model = latency.LatencyModel(
        model="tiny",
        by_tp={1: latency.TpLatency(*(latency.Coefficients(1.0, 0.01, 1e-6),) * 3, threshold=8)},
        source="test",
        max_batch_tokens=256,
        fit_error={"prefill": {"mean_rel": 0.01}},
        iteration_overhead_ms=0.7,
        iteration_overhead_ms_per_token=2e-5,
    )
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(model.to_json()))
    loaded = latency.load(path)
    assert loaded.by_tp == model.by_tp
    assert loaded.iteration_ms(1000) == pytest.approx(0.7 + 0.02)
    assert loaded.saturation_tokens(1) == 256
    assert latency.for_model(PRESETS["opt-13b"], path).model == "tiny"  # ours wins as given


def test_malformed_profiles_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidRequest, match="cannot read profile"):
        latency.load(bad)
    bad.write_text(json.dumps({"format": latency.FORMAT, "model": "x"}))
    with pytest.raises(InvalidRequest, match="malformed"):
        latency.load(bad)
    with pytest.raises(InvalidRequest, match="name one of them"):
        latency.load(latency.PUBLISHED["distserve"], model="opt-30b")


def test_a_colocated_profile_the_user_names_is_the_one_used():
    """Named, the published DistServe fit times the baseline; not named, the vLLM fit beside the
    profile does, and its source says that it is the default and why."""
    spec, published = PRESETS["opt-13b"], latency.PUBLISHED["distserve"]
    named = latency.colocated_for_model(spec, published, None)
    assert named.source == str(published)
    assert named.at(1).prefill == latency.for_model(spec, published).at(1).prefill
    default = latency.colocated_for_model(spec, None, published)
    assert default.source.startswith(str(latency.PUBLISHED["vllm"]))
    assert "by default" in default.source and "vLLM" in default.source
    assert default.at(1).prefill == latency.for_model(spec, None, "vllm").at(1).prefill
    assert default.at(1).prefill != named.at(1).prefill
