"""DeepSeek-V2: multi-head latent attention (MLA) over a cache of one latent vector per token.

Each layer compresses a token's keys and values into a latent `c` of kv_lora_rank entries
(kv_a_proj_with_mqa, then an RMS norm) plus one rotary key `k_pe` of qk_rope_head_dim entries
shared by every head; kv_b_proj expands `c` into each head's non-rotary key (W_UK) and value
(W_UV). The cache keeps [c, k_pe] only (services/engine/kv_cache.py, one plane of one head),
and every tensor-parallel rank keeps all of it: each rank's query heads read the whole latent.

Attention runs in the absorbed form: W_UK is folded into the queries (q_nope @ W_UK, per head),
so a head's score is [q_nope W_UK, q_pe] . [c, k_pe], the same number as q . k of the expanded
keys; the weights then sum the latents `c`, and W_UV maps that sum to the head's value. The
latent is thus the one KV head every query head shares (multi-query attention of width
kv_lora_rank + qk_rope_head_dim), read by the same attention backend as every other family,
and no step expands a context's cached latents into keys and values.

The rest is Llama's shape: pre-norm layers, RMSNorm, SwiGLU MLP. The rotary part rotates pairs
of adjacent entries (transformers' complex form), not the two halves as Llama does. With yarn
rope scaling (DeepSeek-V2's checkpoints), cos and sin carry yarn's attention factor and the
softmax scale is multiplied by mscale(factor, mscale_all_dim)^2 (services/engine/rope.py).

Layers from `first_k_dense_replace` on replace the MLP with a mixture of experts (moe.py): a
softmax router over `n_routed_experts`, greedy or group-limited (`topk_method`, `n_group`,
`topk_group`), its top `num_experts_per_tok` weighted by their probabilities times
`routed_scaling_factor`, plus `n_shared_experts` shared experts: one gated MLP of
n_shared_experts * moe_intermediate_size that every token runs through. The earlier layers keep
a dense MLP of `intermediate_size`. Router options we do not implement are refused by name
(services/common/model_config.py).
"""

from __future__ import annotations

import torch
from torch import nn

from services.common.errors import UnsupportedModel
from services.common.model_config import ModelConfig
from services.engine.attention import AttentionContext, AttentionSpec
from services.engine.gemm import Linear
from services.engine.models.base import CausalLM, Target
from services.engine.models.layers import (
    ColumnLinear,
    GatedMLP,
    LMHead,
    RMSNorm,
    RowLinear,
    VocabEmbedding,
)
from services.engine.models.moe import GroupLimit, SparseMoE, with_experts
from services.engine.parallel import TensorParallel
from services.engine.rope import attention_factor, inverse_frequencies, softmax_mscale

LATENT_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers' default, not rms_norm_eps


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, heads, d) by its positions, each pair (x[2i], x[2i + 1]) by angle i;
    cos, sin (T, 1, d / 2)."""
    pairs = x.float().unflatten(-1, (-1, 2))  # (T, heads, d / 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).to(x.dtype)


class LatentAttention(nn.Module):
    """MLA for this rank's query heads: q (through a low-rank q_a/q_b when q_lora_rank is set),
    the latent [c, k_pe] computed whole on every rank, attention over the cached latents, and
    the output projection."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        raw = cfg.raw
        self.layer = layer
        self.num_heads = cfg.num_heads // tp.world_size
        self.kv_lora_rank = int(raw.get("kv_lora_rank", 512))
        self.nope = int(raw.get("qk_nope_head_dim", 128))
        self.rope = int(raw.get("qk_rope_head_dim", 64))
        self.v_dim = int(raw.get("v_head_dim", 128))
        q_width = cfg.num_heads * (self.nope + self.rope)
        q_lora_rank = raw.get("q_lora_rank")
        bias = cfg.biases.qkv
        if q_lora_rank is None:
            self.q_proj = ColumnLinear(cfg.hidden_size, (q_width,), False, tp)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, int(q_lora_rank), bias=bias)
            self.q_a_layernorm = RMSNorm(int(q_lora_rank), LATENT_NORM_EPS)
            self.q_b_proj = ColumnLinear(int(q_lora_rank), (q_width,), False, tp)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.kv_lora_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LATENT_NORM_EPS)
        # Never applied as a layer: its rows, per head W_UK (nope) then W_UV (v), are absorbed.
        self.kv_b_proj = ColumnLinear(
            self.kv_lora_rank, (cfg.num_heads * (self.nope + self.v_dim),), False, tp
        )
        self.o_proj = RowLinear(cfg.num_heads * self.v_dim, cfg.hidden_size, cfg.biases.o, tp)

    def forward(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], attn: AttentionContext
    ) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(T, H, -1).split((self.nope, self.rope), dim=-1)  # (T, H, *)
        c, k_pe = self.kv_a_proj_with_mqa(x).split((self.kv_lora_rank, self.rope), dim=-1)
        cos, sin = rotary
        q_pe = rope_pairs(q_pe, cos, sin)
        k_pe = rope_pairs(k_pe[:, None], cos, sin)  # (T, 1, rope)
        latent = torch.cat((self.kv_a_layernorm(c)[:, None], k_pe), dim=-1)  # (T, 1, R + rope)
        w = self.kv_b_proj.weight.view(H, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # (H, nope, R), (H, v, R)
        q_c = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # (T, H, R)
        o = attn.latent(self.layer, torch.cat((q_c, q_pe), dim=-1), latent, self.kv_lora_rank)
        o = torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2))  # (H, T, v)
        return self.o_proj(o.transpose(0, 1).reshape(T, H * self.v_dim))


def mixture_of_experts(cfg: ModelConfig, tp: TensorParallel) -> SparseMoE:
    """A sparse layer's block: routed experts of moe_intermediate_size (cfg.intermediate_size)
    and the shared experts."""
    raw = cfg.raw
    limited = raw.get("topk_method") == "group_limited_greedy"
    return SparseMoE(
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_experts,
        cfg.experts_per_token,
        cfg.hidden_act,
        tp,
        renormalize=False,  # norm_topk_prob true is refused (model_config.py)
        group_limit=GroupLimit(int(raw["n_group"]), int(raw["topk_group"])) if limited else None,
        routed_scale=float(raw.get("routed_scaling_factor", 1.0)),
        router_in_float32=True,
        shared=cfg.shared_intermediate_size,
        shared_bias=cfg.biases.mlp,
    )


def dense(cfg: ModelConfig, tp: TensorParallel) -> GatedMLP:
    """A dense layer's SwiGLU MLP of intermediate_size."""
    width = cfg.dense_intermediate_size
    if width % tp.world_size:
        raise UnsupportedModel(
            f"tensor parallelism tp={tp.world_size} does not divide the dense layers' "
            f"intermediate_size ({width}); choose a tp that divides it"
        )
    return GatedMLP(cfg.hidden_size, width, cfg.biases.mlp, cfg.hidden_act, tp)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = LatentAttention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = mixture_of_experts(cfg, tp) if layer in cfg.sparse_layers else dense(cfg, tp)

    def forward(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], attn: AttentionContext
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


class DeepseekV2ForCausalLM(CausalLM):
    """DeepSeek-V2: MLA over a latent KV cache; dense SwiGLU MLPs, then mixtures of experts."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__(cfg, tp)
        raw = cfg.raw
        self.rope_dim = int(raw.get("qk_rope_head_dim", 64))
        qk_head_dim = int(raw.get("qk_nope_head_dim", 128)) + self.rope_dim
        # The absorbed scores equal q . k of the expanded heads: their scale, not the latent's.
        scale = qk_head_dim**-0.5 * softmax_mscale(cfg.rope)
        self.attention_specs = [AttentionSpec(scale=scale)] * cfg.num_layers
        self.model = Decoder(cfg, tp)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp)

    def init_buffers(self, device: torch.device) -> None:
        self.inv_freq = inverse_frequencies(self.config.rope, self.rope_dim).to(device)
        self.rope_scale = attention_factor(self.config.rope)

    def rotary(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each position and frequency, times yarn's attention factor, float32
        (T, 1, rope_dim / 2) each."""
        freqs = positions.float()[:, None, None] * self.inv_freq  # (T, 1, rope_dim / 2)
        if self.rope_scale == 1.0:
            return freqs.cos(), freqs.sin()
        return freqs.cos() * self.rope_scale, freqs.sin() * self.rope_scale

    def checkpoint_map(self) -> dict[str, Target]:
        return with_experts(self, super().checkpoint_map())
