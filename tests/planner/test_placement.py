"""Placement: constraints hold in every plan; low affinity keeps a stage's segments on one node;
infeasible inputs are clear errors."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidRequest
from services.common.latency import for_model
from services.common.model_spec import (
    GIB,
    PRESETS,
    computed_kv_capacity,
    model_spec,
    published_kv_capacity,
)
from services.common.slo import Slo
from services.planner.cluster import ClusterSpec, kv_capacity, parallel_problem
from services.planner.mapping import first_fit
from services.planner.placement import Plan, PlanSpec, plan
from services.planner.workload import PRESETS as WORKLOADS
from services.planner.workload import parse_workload


def spec_for(model: str, cluster: str, **kw) -> PlanSpec:
    m = PRESETS[model]
    fields = {
        "workload": WORKLOADS["chat"],
        "slo": Slo(4.0, 0.2) if model == "opt-175b" else Slo(0.4, 0.1),
        "num_requests": 400,
        "precision": None,  # these test the search; test_goodput and test_plan the refinement
        **kw,
    }
    return PlanSpec(
        model=m,
        cluster=ClusterSpec.parse(cluster),
        latency=for_model(m, None),
        colocated_latency=for_model(m, None, "vllm"),
        **fields,
    )


def check_constraints(p: Plan) -> None:
    s = p.spec
    for placement in (p.placement, p.colocated):
        used: set[tuple[int, int]] = set()
        for inst in placement.instances:
            assert s.model.num_heads % inst.tp == 0
            assert s.model.num_layers % inst.pp == 0
            assert kv_capacity(s.model, inst.tp, inst.pp, s.cluster) >= s.workload.max_tokens
            assert len(inst.gpus) == inst.pp
            for stage in inst.gpus:
                assert len(stage) == inst.tp
                assert len({node for node, _ in stage}) == 1  # tensor parallelism inside a node
                for node, gpu in stage:
                    assert 0 <= node < s.cluster.nodes and 0 <= gpu < s.cluster.gpus_per_node
                    assert (node, gpu) not in used  # no GPU used twice
                    used.add((node, gpu))
        assert placement.num_gpus == len(used) <= s.cluster.num_gpus


@pytest.fixture(scope="module")
def plan_175b() -> Plan:
    return plan(spec_for("opt-175b", "4x8"))


def test_175b_on_4x8_respects_every_constraint(plan_175b):
    check_constraints(plan_175b)
    assert plan_175b.placement.goodput > 0 and plan_175b.colocated.goodput > 0
    assert plan_175b.ratio == pytest.approx(
        plan_175b.placement.per_device / plan_175b.colocated.per_device
    )


def test_low_affinity_keeps_each_stage_on_one_node(plan_175b):
    low = plan_175b.candidates["low-affinity"]
    prefill = [i for i in low.instances if i.role == "prefill"]
    decode = [i for i in low.instances if i.role == "decode"]
    assert prefill and decode
    # every decode instance shares, stage by stage, its nodes with some prefill instance
    prefill_nodes = {p.nodes for p in prefill}
    for d in decode:
        assert d.nodes in prefill_nodes
        assert len(set(d.nodes)) == d.pp  # one node per stage


def test_slow_network_prefers_low_affinity(plan_175b):
    # 25 Gb/s between nodes: 175B's KV (4.7 MB per token) cannot cross nodes in time
    assert plan_175b.placement.algorithm == "low-affinity"
    high = plan_175b.candidates["high-affinity"]
    assert plan_175b.placement.per_device > high.per_device


def test_a_target_rate_gets_enough_replicas():
    p = plan(spec_for("opt-13b", "2x8", rate=20.0, affinity="high"))
    check_constraints(p)
    prefill, decode = p.placement.phase("prefill"), p.placement.phase("decode")
    assert prefill.replicas * prefill.instance_goodput >= 20.0
    assert decode.replicas * decode.instance_goodput >= 20.0


def test_too_high_a_rate_is_a_clear_error():
    with pytest.raises(InvalidRequest, match="the cluster has 8"):
        plan(spec_for("opt-13b", "1x8", rate=10_000.0, affinity="high"))


def test_a_model_too_big_for_the_cluster_is_a_clear_error():
    with pytest.raises(InvalidRequest, match="fits no parallel configuration"):
        plan(spec_for("opt-175b", "1x4"))


def test_an_impossible_slo_is_a_clear_error():
    with pytest.raises(InvalidRequest, match="meets the SLO"):
        plan(spec_for("opt-13b", "1x4", slo=Slo(0.001, 0.001)))


def test_parallel_constraints_name_the_problem():
    m, c = PRESETS["opt-66b"], ClusterSpec(2, 8)
    assert "does not divide the 72 attention heads" in parallel_problem(m, 5, 1, c, 2048)
    assert "does not divide the 64 layers" in parallel_problem(m, 2, 3, c, 2048)
    assert "exceeds the 4 GPUs of a node" in parallel_problem(m, 8, 1, ClusterSpec(4, 4), 2048)
    assert "weights per GPU" in parallel_problem(m, 1, 1, c, 2048)  # 132 GB on one 80 GB GPU
    assert parallel_problem(m, 4, 2, c, 2048) is None


def test_computed_memory_matches_the_published_table():
    for (name, tp, pp), tokens in published_kv_capacity().items():
        m = model_spec(name)
        assert computed_kv_capacity(m, tp, pp) == pytest.approx(tokens, rel=0.07)
    # another GPU size: computed, and larger memory holds more
    big = ClusterSpec(1, 8, gpu_memory_bytes=141 * GIB)
    c = ClusterSpec(1, 8)
    assert kv_capacity(PRESETS["opt-13b"], 1, 1, big) > kv_capacity(PRESETS["opt-13b"], 1, 1, c)


def test_first_fit_keeps_tensor_groups_inside_nodes_or_fails():
    c = ClusterSpec(2, 4)
    mapped = first_fit([("prefill", 4, 1), ("decode", 2, 2)], c)
    assert mapped is not None
    assert first_fit([("prefill", 4, 1), ("decode", 4, 1), ("decode", 1, 1)], c) is None


def test_model_spec_from_a_model_folder(tiny_model):
    m = model_spec(tiny_model)
    assert (m.num_layers, m.num_heads, m.num_kv_heads) == (2, 4, 2)
    assert m.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K and V, layers, kv heads, head dim, fp32
    with pytest.raises(InvalidRequest, match="unknown model"):
        model_spec("opt-7b")


def test_workload_max_tokens_bounds_memory():
    # a 13B instance at tp=1 holds 66144 tokens; a workload longer than that has no placement
    huge = parse_workload("prompt=fixed:1000,output=fixed:70000")
    with pytest.raises(InvalidRequest, match="fits no parallel configuration"):
        plan(spec_for("opt-13b", "1x1", workload=huge))


def test_model_spec_of_moe_and_latent_folders_counts_what_they_hold(tmp_path):
    """A mixture of experts stores every expert (its weights, the planner's memory) but runs
    its routed ones (its FLOPs, the latency's scaling); a latent-attention model caches one
    latent per token and layer. Checked against the models transformers builds."""
    transformers = pytest.importorskip("transformers")
    import torch

    from tests.engine.families import FAMILIES

    for name in ("mixtral", "qwen3-moe", "deepseek-v2", "qwen3"):
        config_class, kwargs = FAMILIES[name]
        config = getattr(transformers, config_class)(vocab_size=1000, **kwargs)
        config.architectures = [config_class.replace("Config", "ForCausalLM")]
        config.save_pretrained(tmp_path / name)
        spec = model_spec(tmp_path / name)
        with torch.device("meta"):
            hf = transformers.AutoModelForCausalLM.from_config(config)
        stored = sum(p.numel() for p in hf.parameters())  # lm_head untied in these configs
        assert spec.num_params == pytest.approx(stored, rel=0.1), name
        if name in ("mixtral", "qwen3-moe", "deepseek-v2"):
            idle = spec.num_experts - spec.experts_per_token  # experts a token does not run
            expert = 3 * spec.hidden_size * spec.expert_intermediate_size
            assert spec.num_params - spec.active_params == spec.sparse_layers * idle * expert
        else:
            assert spec.active_params == spec.num_params
    latent = model_spec(tmp_path / "deepseek-v2")
    per_layer = FAMILIES["deepseek-v2"][1]
    width = per_layer["kv_lora_rank"] + per_layer["qk_rope_head_dim"]
    assert latent.kv_bytes_per_token == latent.num_layers * width * latent.dtype_bytes
    qwen3 = model_spec(tmp_path / "qwen3")  # head_dim 32, not hidden / heads = 16
    assert qwen3.kv_bytes_per_token == 2 * 2 * 2 * 32 * qwen3.dtype_bytes
