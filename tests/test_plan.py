"""`distserve profile` on the tiny model and `distserve plan`, through distserve/plan.py."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from distserve import plan as plan_cli
from services.common.latency import load
from services.common.model_config import ModelConfig
from services.common.model_spec import PRESETS, model_spec
from services.engine.models import FAMILIES


def test_profile_writes_a_profile_with_a_sane_fit(tiny_model, tmp_path, capsys):
    out = tmp_path / "profile.json"
    assert plan_cli.main(["profile", "--model", str(tiny_model), "--quick", "--out", str(out)]) == 0
    raw = json.loads(out.read_text())
    assert raw["fit_error"]["prefill"]["mean_rel"] < 0.5
    assert raw["fit_error"]["decode"]["mean_rel"] < 0.5
    assert raw["fit_error"]["prefill"]["samples"] == len(raw["samples"]["prefill"])
    model = load(out)
    tp1 = model.at(1)
    # more tokens take longer, in both phases, and everything is non-negative
    assert tp1.prefill_ms(512, 512**2) > tp1.prefill_ms(16, 16**2) > 0
    assert tp1.decode_ms(16, 16 * 256) > tp1.decode_ms(1, 32) > 0
    assert min(tp1.prefill.to_list() + tp1.decode_small.to_list()) >= 0
    assert model.max_batch_tokens in dict(raw["samples"]["lm_tokens_per_s"])
    assert "L_m =" in capsys.readouterr().out


def test_plan_prints_the_placement_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = [
        "plan", "--model-spec", "opt-13b", "--cluster", "1x4", "--workload", "code",
        "--slo", "250,100", "--num-requests", "300", "--precision", "0.03", "--out", str(out),
    ]  # fmt: skip
    assert plan_cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "placement (" in printed and "colocated baseline" in printed and "ratio over" in printed
    plan = json.loads(out.read_text())
    assert plan["placement"]["num_gpus"] <= 4
    assert set(plan["placement"]["phases"]) == {"prefill", "decode"}
    assert plan["ratio_over_colocated"] > 0
    # Which latency timed each side, the colocated default with its reason, in both outputs.
    assert plan["latency_source"].endswith("distserve.json")
    assert "vllm.json (the vLLM fit, by default" in plan["colocated_latency_source"]
    assert f"colocated baseline's latency: {plan['colocated_latency_source']}" in printed
    # The published fits' per-iteration overhead, added by the simulator, said in both.
    assert plan["iteration_overhead_ms"]["latency"] == [2.0, 1e-4]
    assert "+ 2 ms + 0.0001 ms per token each iteration" in printed
    # Every goodput with its 95% interval and the simulated requests behind it, in both; the
    # two reported ones refined to the precision asked, on more requests than the search's.
    for side in ("placement", "colocated"):
        g = plan[side]["goodput"]
        low, high = g["ci95_rps"]
        assert low <= g["rps"] == plan[side]["goodput_rps"] <= high
        assert (high - low) / 2 <= 0.03 * g["rps"] + 1e-4
        assert g["requests"] > 300 * plan[side]["num_gpus"]
        shown = f"{g['rps']:.3g} req/s [{low:.3g}, {high:.3g}] ({g['requests']:,} requests)"
        assert shown in printed
    for phase in plan["placement"]["phases"].values():
        g = phase["instance_goodput"]
        assert f"alone: {g['rps']:.3g} req/s [" in printed and g["requests"] >= 300
    assert "re-simulated until within +-3.00% (or 400,000 more requests each)" in printed
    assert plan["precision"] == 0.03 and plan["refine_requests"] == 400_000
    assert plan["plan_seconds"] >= plan["search_seconds"] > 0


def test_a_plan_out_of_refinement_budget_says_how_far_it_got(tmp_path, capsys):
    argv = [
        "plan", "--model-spec", "opt-13b", "--cluster", "1x2", "--workload",
        "prompt=fixed:512,output=fixed:64", "--slo", "400,40", "--refine-requests", "0",
        "--out", str(tmp_path / "plan.json"),
    ]  # fmt: skip
    assert plan_cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "the budget ended first, at +-" in printed and "(raise --refine-requests)" in printed


def test_plan_errors_are_one_line_and_exit_2(tmp_path, capsys):
    argv = ["plan", "--model-spec", "opt-175b", "--cluster", "1x2", "--slo", "1000,100"]
    assert plan_cli.main([*argv, "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("distserve: error: opt-175b fits no parallel configuration")


def test_register_adds_both_commands_with_their_functions():
    parser = argparse.ArgumentParser()
    plan_cli.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["profile", "--quick"])
    assert args.func is plan_cli.profile_command
    args = parser.parse_args(
        ["plan", "--model-spec", "opt-13b", "--cluster", "1x8", "--slo", "1,1"]
    )
    assert args.func is plan_cli.plan_command


def test_an_opt_folder_plans_as_the_paper_model_it_is(tmp_path):
    """`distserve plan --model-spec <an OPT-13B folder>` and `--model-spec opt-13b` agree, and
    the folder is one the real engine serves (its config.json as transformers writes it)."""
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "opt-13b"
    config = transformers.OPTConfig(
        hidden_size=5120,
        num_hidden_layers=40,
        num_attention_heads=40,
        ffn_dim=20480,
        vocab_size=50272,
        max_position_embeddings=2048,
        word_embed_proj_dim=5120,
        dtype="float16",
    )
    config.architectures = ["OPTForCausalLM"]
    config.save_pretrained(folder)
    assert ModelConfig.from_dir(folder).architecture in FAMILIES
    assert model_spec(folder) == dataclasses.replace(PRESETS["opt-13b"], name="opt-13b")
    plans = []
    for spec in ("opt-13b", str(folder)):
        out = tmp_path / f"{len(plans)}.json"
        argv = [
            "plan", "--model-spec", spec, "--cluster", "1x2", "--workload",
            "prompt=fixed:512,output=fixed:64", "--slo", "400,40", "--num-requests", "200",
            "--precision", "0", "--out", str(out),
        ]  # fmt: skip
        assert plan_cli.main(argv) == 0
        plan = json.loads(out.read_text())
        plans.append((plan["placement"], plan["ratio_over_colocated"], plan["latency_source"]))
    assert plans[0] == plans[1]
