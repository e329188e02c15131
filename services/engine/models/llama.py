"""The Llama family: Llama, Mistral, Qwen2 (biases on q/k/v) and Qwen3 (RMS norms of q and k).

Pre-norm decoder layers: RMSNorm, attention with rotary positions, RMSNorm, SwiGLU MLP.
"""

from __future__ import annotations

import torch
from torch import nn

from services.common.model_config import ModelConfig
from services.engine.attention import AttentionContext
from services.engine.models.base import CausalLM
from services.engine.models.layers import Attention, GatedMLP, LMHead, RMSNorm, VocabEmbedding
from services.engine.parallel import TensorParallel


class DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, tp: TensorParallel, family: type[LlamaForCausalLM]
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.self_attn = Attention(
            cfg, layer, tp, qkv_packed_from=family.qkv_packed_from, qk_norm=family.qk_norm
        )
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = family.mlp(cfg, layer, tp)

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        attn: AttentionContext,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, family: type[LlamaForCausalLM]):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp, family) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


class LlamaForCausalLM(CausalLM):
    """Llama, and the families that differ from it only in what its class attributes say."""

    qkv_packed_from: tuple[str, ...] | None = ("q_proj", "k_proj", "v_proj")
    mlp_packed_from: tuple[str, ...] | None = ("gate_proj", "up_proj")
    qk_norm = False

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__(cfg, tp)
        self.model = Decoder(cfg, tp, type(self))
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp)

    @classmethod
    def mlp(cls, cfg: ModelConfig, layer: int, tp: TensorParallel) -> nn.Module:
        """Layer `layer`'s feed-forward block: a gated MLP here, experts in MoE families."""
        return GatedMLP(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.biases.mlp,
            cfg.hidden_act,
            tp,
            cls.mlp_packed_from,
        )


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: Llama with an RMS norm over each head of q and of k, before the rotation."""

    qk_norm = True
