"""Every model family against transformers, on checkpoints transformers writes (fp32, CPU).

For each family: logits of a prefill and of the decode steps after it within fp32 tolerance of
transformers' forward pass over the same tokens; greedy generation of a batch identical to
transformers' `generate` over 32 tokens; and a prompt served from the prefix cache identical to
one computed whole. For the mixture-of-experts families: the checkpoint is in the Hub's
per-expert layout, and the test prompts route tokens to every expert. Tensor parallelism:
tests/engine/test_tensor_parallel.py; through the mesh: tests/test_families_mesh.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from services.common.errors import InvalidRequest, ModelLoadError, UnsupportedModel
from services.common.model_config import ModelConfig, experts_of
from services.common.sampling import SamplingParams
from services.engine.attention import make_backend
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.models.moe import SparseMoE
from tests.engine.families import FAMILIES, write_family
from tests.engine.test_parity_transformers import hf_greedy, hf_model, teacher_forced_logits

transformers = pytest.importorskip("transformers")

# family -> (its MoE block's name in the checkpoint, an expert's gate projection, MoE layers)
MOE = {
    "mixtral": ("block_sparse_moe", "w1", [0, 1]),
    "qwen3-moe": ("mlp", "gate_proj", [0, 2]),  # layer 1 is in mlp_only_layers: dense
    "deepseek-v2": ("mlp", "gate_proj", [1, 2]),  # first_k_dense_replace 1: layer 0 dense
    "deepseek-v2-plain-q": ("mlp", "gate_proj", [0, 1]),
}


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = write_family(name, tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers(family, name):
    path = family(name)
    engine = LLMEngine(path, EngineConfig(num_blocks=64, block_size=16, prefix_cache=False))
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(2, engine.model_config.vocab_size, (120,), generator=gen).tolist()
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]  # (120, vocab)
    ours = teacher_forced_logits(engine, ids, prefill_len=70)  # positions 69..119
    assert ours.shape == ref[69:].shape
    diff = (ours - ref[69:]).abs().max().item()
    assert diff <= 1e-4, f"max abs logit difference {diff}"
    assert ref[69:].std() > 0.5  # logits well spread: a wrong model could not pass by luck


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_batch_equals_transformers_generate(family, name):
    path = family(name)
    engine = LLMEngine(path, EngineConfig(num_blocks=128, block_size=8))
    hf = hf_model(path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 900, (n,), generator=gen).tolist() for n in (1, 5, 17, 40)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for prompt, res in zip(prompts, engine.generate(prompts, params), strict=True):
        assert res.token_ids == hf_greedy(hf, prompt, 32), f"prompt of {len(prompt)} diverged"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_prefix_cache_gives_the_tokens_of_a_whole_prefill(family, name):
    path = family(name)
    engine = LLMEngine(path, EngineConfig(num_blocks=128, block_size=8, prefix_cache=True))
    hf = hf_model(path)
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(2, 900, (33,), generator=gen).tolist()
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.generate([[*shared, 5, 6, 7]], params)  # leaves 4 full blocks cached
    prompt = [*shared, 9, 10, 11, 12]
    rid = engine.add_request(prompt, params)
    tokens, cached, done = [], None, False
    while not done:
        for o in engine.step():
            assert o.request_id == rid
            cached = o.num_cached_tokens if cached is None else cached
            tokens += o.new_token_ids
            done = o.finished
    assert cached == 32  # the 4 shared blocks came from the cache
    assert tokens == hf_greedy(hf, prompt, 24)


def _flash() -> bool:
    from services.engine.attention import flash_available

    return torch.cuda.is_available() and flash_available(torch.device("cuda"))


@pytest.mark.skipif(not _flash(), reason="needs CUDA and flash-attn (bench/gpu_check.sh)")
@pytest.mark.parametrize("name", list(FAMILIES))
def test_flash_attention_matches_torch_attention_on_cuda(family, name):
    """bf16 on the GPU, every family: flash-attn's varlen prefill, its paged decode (blocks of
    256), and its prefill over a cached prefix, against the torch backend on the same device and
    weights, within bf16's rounding of the logits. (A latent model's 576-wide head is past
    flash-attn's 256: it is refused, tested below.)"""
    path = family(name)
    if ModelConfig.from_dir(path).kv_latent:
        pytest.skip("flash-attn is refused for latent attention")

    def engine(attention: str, prefix_cache: bool) -> LLMEngine:
        config = EngineConfig(
            num_blocks=16,
            block_size=256,
            dtype="bfloat16",
            device="cuda",
            attention=attention,
            prefix_cache=prefix_cache,
        )
        return LLMEngine(path, config)

    gen = torch.Generator().manual_seed(9)
    first = torch.randint(2, 900, (600,), generator=gen).tolist()
    ids = first[:512] + torch.randint(2, 900, (100,), generator=gen).tolist()
    reference = teacher_forced_logits(engine("torch", False), ids, 560)
    flash = engine("flash", True)
    assert flash.runner.backend.name == "flash" and flash.runner.backend.needs_block_tables
    whole = teacher_forced_logits(flash, ids, 560)
    flash.generate([first], SamplingParams(max_tokens=1))  # caches the first 512 tokens' blocks
    cached = teacher_forced_logits(flash, ids, 560)  # prefill of 48 tokens over 512 cached
    scale = reference.abs().max().item()
    for got in (whole, cached):
        assert (got - reference).abs().max().item() <= 0.03 * scale


@pytest.mark.parametrize("name", list(MOE))
def test_moe_checkpoint_is_per_expert_and_prompts_reach_every_expert(family, name):
    """The loader reads the Hub layout (one tensor per expert and projection, as
    save_pretrained writes it); and the exactness tests above exercise real routing: across a
    prompt's tokens, every MoE layer sends tokens to every one of its experts. A group-limited
    router (DeepSeek-V2's) picks each token's experts within its topk_group groups."""
    path = family(name)
    block, gate, moe_layers = MOE[name]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    first = moe_layers[0]
    assert f"model.layers.{first}.{block}.experts.3.{gate}.weight" in keys
    assert not any(k.endswith("gate_up_proj") for k in keys)  # not transformers' fused layout

    engine = LLMEngine(path, EngineConfig(num_blocks=64, block_size=16, prefix_cache=False))
    mc = engine.model_config
    chosen: dict[int, set[int]] = {}
    groups_used: set[int] = set()
    hooks = []
    for i, layer in enumerate(engine.runner.model.model.layers):
        if isinstance(layer.mlp, SparseMoE):

            def record(module, args, i=i):
                experts = module.route(args[0])[1]  # (T, k)
                chosen.setdefault(i, set()).update(experts.flatten().tolist())
                if module.group_limit is not None:
                    size = mc.num_experts // module.group_limit.groups
                    groups_used.update(len(set((row // size).tolist())) for row in experts)

            hooks.append(layer.mlp.register_forward_pre_hook(record))
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, 900, (40,), generator=gen).tolist()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    for h in hooks:
        h.remove()
    assert sorted(chosen) == moe_layers
    for i, experts in chosen.items():
        assert experts == set(range(mc.num_experts)), f"layer {i} routed only to {sorted(experts)}"
    if mc.raw.get("topk_method") == "group_limited_greedy":
        assert max(groups_used) == mc.raw["topk_group"]  # never more; the limit is reached


@pytest.mark.parametrize(
    "change, message",
    [
        ({"num_experts_per_tok": 5}, "1 <= num_experts_per_tok <= num_local_experts"),
        ({"num_local_experts": 0}, "num_local_experts >= 1"),
        ({"num_experts_per_tok": None}, "num_experts_per_tok"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be an integer >= 1"),
        ({"mlp_only_layers": "1"}, "mlp_only_layers must list layer indices"),
    ],
)
def test_moe_config_out_of_range_is_refused_by_name(family, change, message):
    raw = json.loads((family("qwen3-moe") / "config.json").read_text())
    raw = {k: v for k, v in {**raw, **change}.items() if v is not None}
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_dict(raw)


def test_qwen3_moe_hub_config_names_its_experts_num_experts(family):
    """Qwen3-MoE's Hub config.json says `num_experts`; transformers 5 writes
    `num_local_experts`: both read."""
    raw = json.loads((family("qwen3-moe") / "config.json").read_text())
    raw["num_experts"] = raw.pop("num_local_experts")
    assert experts_of(ModelConfig.from_dict(raw).raw) == (4, 2)


def test_deepseek_v2_caches_one_latent_per_token_and_layer(family):
    path = family("deepseek-v2")
    engine = LLMEngine(path, EngineConfig(num_blocks=8, block_size=8))
    mc, raw = engine.model_config, engine.model_config.raw
    latent = raw["kv_lora_rank"] + raw["qk_rope_head_dim"]
    assert engine.runner.cache.data.shape == (mc.num_layers, 1, 8, 8, 1, latent)
    assert mc.kv_bytes_per_token(4) == mc.num_layers * latent * 4  # not K and V heads


def test_deepseek_v2_layers_and_experts_as_its_config_says(family):
    mc = ModelConfig.from_dir(family("deepseek-v2"))
    assert mc.sparse_layers == (1, 2)  # from first_k_dense_replace on
    assert (mc.num_experts, mc.experts_per_token) == (8, 3)
    assert (mc.intermediate_size, mc.dense_intermediate_size) == (32, 160)
    assert mc.rope.type == "yarn" and mc.rope.factor == 4.0
    raw = json.loads((family("deepseek-v2") / "config.json").read_text())
    dense = ModelConfig.from_dict({**raw, "first_k_dense_replace": 3})  # every layer dense
    assert (dense.sparse_layers, dense.num_experts, dense.intermediate_size) == ((), 0, 160)


@pytest.mark.parametrize(
    "change, error, message",
    [
        ({"topk_method": "noaux_tc"}, UnsupportedModel, "topk_method 'noaux_tc'"),
        ({"scoring_func": "sigmoid"}, UnsupportedModel, "scoring_func 'sigmoid'"),
        ({"norm_topk_prob": True}, UnsupportedModel, "norm_topk_prob true"),
        ({"moe_layer_freq": 2}, UnsupportedModel, "moe_layer_freq 2"),
        ({"n_group": 3}, ModelLoadError, "n_group, an integer >= 1 dividing n_routed_experts"),
        ({"topk_group": 5}, ModelLoadError, r"1 <= topk_group <= n_group \(4\)"),
        ({"topk_group": 1}, ModelLoadError, r"num_experts_per_tok \(3\) exceeds"),
        ({"num_experts_per_tok": None}, ModelLoadError, "num_experts_per_tok"),
        ({"first_k_dense_replace": -1}, ModelLoadError, "first_k_dense_replace must be"),
    ],
)
def test_deepseek_v2_router_options_we_do_not_implement_are_refused_by_name(
    family, change, error, message
):
    raw = json.loads((family("deepseek-v2") / "config.json").read_text())
    raw = {k: v for k, v in {**raw, **change}.items() if v is not None}
    with pytest.raises(error, match=message):
        ModelConfig.from_dict(raw)


def test_latent_attention_is_refused_by_flash_attention():
    with pytest.raises(InvalidRequest, match="cannot read a latent KV cache"):
        make_backend(
            "flash",
            num_heads=4,
            num_kv_heads=1,
            block_size=256,
            device=torch.device("cuda"),
            dtype=torch.float16,
            latent=True,
        )
