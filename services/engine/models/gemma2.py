"""Gemma 2: scaled embeddings, RMS norms stored as (scale - 1) around both blocks of a layer,
GeGLU, attention scores scaled by query_pre_attn_scalar and soft-capped, sliding-window and
global layers alternating, and soft-capped final logits. The LM head is the token embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from services.common.model_config import ModelConfig
from services.engine.attention import AttentionContext, AttentionSpec
from services.engine.models.base import CausalLM
from services.engine.models.layers import Attention, GatedMLP, LMHead, RMSNorm, VocabEmbedding
from services.engine.parallel import TensorParallel


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.norm_eps
        self.input_layernorm = RMSNorm(h, eps, offset=1.0)
        self.self_attn = Attention(cfg, layer, tp)
        self.post_attention_layernorm = RMSNorm(h, eps, offset=1.0)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, offset=1.0)
        self.mlp = GatedMLP(h, cfg.intermediate_size, cfg.biases.mlp, cfg.hidden_act, tp)
        self.post_feedforward_layernorm = RMSNorm(h, eps, offset=1.0)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        attn: AttentionContext,
    ) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rotary, attn))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, offset=1.0)


class Gemma2ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__(cfg, tp)
        raw = cfg.raw
        scale = float(raw.get("query_pre_attn_scalar") or cfg.head_dim) ** -0.5
        softcap = raw.get("attn_logit_softcapping")
        self.attention_specs = [
            AttentionSpec(scale, cfg.window(i), float(softcap) if softcap else None)
            for i in range(cfg.num_layers)
        ]
        cap = raw.get("final_logit_softcapping")
        self.final_softcap = float(cap) if cap else None
        self.model = Decoder(cfg, tp)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # (T, hidden)
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
