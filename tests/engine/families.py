"""Tiny checkpoints of every model family the engine serves, written by transformers itself.

Each is the family's transformers class with small random weights (seeded: normal with
1/sqrt(fan_in) spread, so logits are well apart and greedy choices are not near-ties), saved with
`save_pretrained` beside the embedded tokenizer: what a user's folder of that family holds,
nothing written by our own code but the tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch

from services.engine.presets import BOS_ID, EOS_ID, build_tokenizer

SMALL = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512
)
IDS = dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)

# name -> (transformers config class name, its arguments beyond the vocabulary)
FAMILIES: dict[str, tuple[str, dict]] = {
    "opt": ("OPTConfig", {**SMALL, "ffn_dim": 160, "word_embed_proj_dim": 64}),
    "qwen3": (
        "Qwen3Config",
        {**SMALL, "intermediate_size": 160, "num_key_value_heads": 2, "head_dim": 32},
    ),
    "phi3": (
        "Phi3Config",
        {
            **SMALL,
            "intermediate_size": 160,
            "num_key_value_heads": 2,
            "original_max_position_embeddings": 512,
        },
    ),
    "gemma2": (
        "Gemma2Config",
        {
            **SMALL,
            "num_hidden_layers": 4,  # sliding and global layers, twice
            "intermediate_size": 160,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "query_pre_attn_scalar": 24,
            "sliding_window": 8,
            "attn_logit_softcapping": 2.0,  # low enough to bend the scores of these weights
            "final_logit_softcapping": 5.0,
        },
    ),
    # Mixture of experts: 4 experts, each token routed to 2 (tests/engine/test_families.py
    # checks that the prompts reach every expert).
    "mixtral": (
        "MixtralConfig",
        {
            **SMALL,
            "intermediate_size": 96,
            "num_key_value_heads": 2,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    # Top-2 without renormalising, and a dense layer between two sparse ones.
    "qwen3-moe": (
        "Qwen3MoeConfig",
        {
            **SMALL,
            "num_hidden_layers": 3,
            "mlp_only_layers": [1],
            "intermediate_size": 160,
            "moe_intermediate_size": 48,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
        },
    ),
    # DeepSeek-V2 as its checkpoints are: a dense first layer, then mixtures of experts (8 routed
    # in 4 groups, each token's top 3 within its 2 best groups, scaled; a shared expert), and
    # yarn rope scaling whose mscales differ, so that both cos/sin and the softmax are scaled.
    "deepseek-v2": (
        "DeepseekV2Config",
        {
            **SMALL,
            "num_hidden_layers": 3,
            "intermediate_size": 160,
            "first_k_dense_replace": 1,
            "moe_intermediate_size": 32,
            "n_routed_experts": 8,
            "num_experts_per_tok": 3,
            "topk_method": "group_limited_greedy",
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 1.5,
            "n_shared_experts": 1,
            "q_lora_rank": 48,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 24,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
            },
        },
    ),
    # q_lora_rank None: one q_proj, as DeepSeek-V2-Lite; and as it, the greedy router over
    # every layer's experts (here from layer 0), two shared experts, plain rotary positions.
    "deepseek-v2-plain-q": (
        "DeepseekV2Config",
        {
            **SMALL,
            "intermediate_size": 160,
            "first_k_dense_replace": 0,
            "moe_intermediate_size": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "topk_method": "greedy",
            "n_shared_experts": 2,
            "q_lora_rank": None,
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
        },
    ),
    "mistral-window": (
        "MistralConfig",
        {**SMALL, "intermediate_size": 160, "num_key_value_heads": 2, "sliding_window": 8},
    ),
}


def write_family(name: str, out: Path, seed: int = 0, **overrides: object) -> Path:
    """Write family `name`'s tiny checkpoint (its config changed by `overrides`, e.g. a larger
    size for bench/engine/families.py) and the tokenizer into `out`; returns `out`."""
    import transformers

    tok = build_tokenizer()
    config_class, kwargs = FAMILIES[name]
    kwargs = {**kwargs, **overrides}
    config = getattr(transformers, config_class)(vocab_size=tok.get_vocab_size(), **IDS, **kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    gemma = name.startswith("gemma")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:  # Gemma stores (scale - 1)
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in pname:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    model.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save(str(out / "tokenizer.json"))
    return out
