"""OPT (Zhang et al. 2022), the models of the DistServe paper.

Learned positions (a table offset by 2, as OPT was trained), LayerNorm with biases, biases on
every projection, a ReLU MLP (fc1, fc2), and an LM head tied to the token embedding. Only the
pre-norm layout (every OPT but opt-350m) is built; ModelConfig refuses the other.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from services.common.model_config import ModelConfig
from services.engine.attention import AttentionContext
from services.engine.models.base import CausalLM
from services.engine.models.layers import (
    ACTIVATIONS,
    Attention,
    ColumnLinear,
    LMHead,
    RowLinear,
    VocabEmbedding,
)
from services.engine.parallel import TensorParallel

POSITION_OFFSET = 2  # OPT's position table starts its positions at row 2


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        h, bias = cfg.hidden_size, cfg.biases.mlp
        self.self_attn_layer_norm = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.self_attn = Attention(cfg, layer, tp, o_name="out_proj")
        self.final_layer_norm = nn.LayerNorm(h, eps=cfg.norm_eps)
        self.fc1 = ColumnLinear(h, (cfg.intermediate_size,), bias, tp)
        self.fc2 = RowLinear(cfg.intermediate_size, h, bias, tp)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, attn: AttentionContext) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), None, attn)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.embed_positions = nn.Embedding(
            cfg.max_position_embeddings + POSITION_OFFSET, cfg.hidden_size
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


class Model(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.decoder = Decoder(cfg, tp)


class OPTForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__(cfg, tp)
        self.model = Model(cfg, tp)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tp)

    embedding = "model.decoder.embed_tokens.weight"

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionContext,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        d = self.model.decoder
        x = d.embed_tokens(input_ids) + d.embed_positions(positions + POSITION_OFFSET)
        for i, layer in enumerate(d.layers):
            x = layer(x, attn)
            if on_layer is not None:
                on_layer(i)
        return d.final_layer_norm(x)
