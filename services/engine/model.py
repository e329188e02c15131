"""The Llama-family decoder (Llama, Qwen2, Mistral) as plain nn.Modules, ordered bottom-up.

Tokens of all sequences in a step are packed along one axis (T); attention finds each sequence's
context through the AttentionContext. q/k/v and gate/up projections are fused into one linear
each; the weight loader fills the fused weights from the checkpoint's separate tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.common.model_config import ModelConfig
from services.engine.attention import AttentionContext
from services.engine.gemm import Linear
from services.engine.rope import apply_rope, cos_sin, inverse_frequencies


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.biases.qkv)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.biases.o)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = apply_rope(q.view(T, self.num_heads, self.head_dim), cos, sin)  # (T, H, D)
        k = apply_rope(k.view(T, self.num_kv_heads, self.head_dim), cos, sin)  # (T, KV, D)
        v = v.view(T, self.num_kv_heads, self.head_dim)  # (T, KV, D)
        o = attn(self.layer, q, k, v)  # (T, H, D)
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.biases.mlp)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.biases.mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionContext
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """A Llama-family causal LM over packed tokens with a paged KV cache."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer(
            "inv_freq", inverse_frequencies(cfg.rope, cfg.head_dim), persistent=False
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionContext,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, hidden). `on_layer(i)` is
        called once layer i has run (its KV is in the cache)."""
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = cos_sin(self.inv_freq, positions, x.dtype)  # (T, 1, D) each
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, attn)
            if on_layer is not None:
                on_layer(i)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32 logits."""
        return self.lm_head(hidden).float()
