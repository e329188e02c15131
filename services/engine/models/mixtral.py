"""Mixtral: Mistral's attention (a sliding window on every layer, if any) and a sparse
mixture of experts in place of the MLP: the top `num_experts_per_tok` of `num_local_experts`,
their softmax probabilities renormalised. The checkpoint calls the block `block_sparse_moe` and
each expert's gate, up and down projections w1, w3 and w2."""

from __future__ import annotations

from torch import nn

from services.common.model_config import ModelConfig
from services.engine.models.base import Target
from services.engine.models.llama import LlamaForCausalLM
from services.engine.models.moe import SparseMoE, with_experts
from services.engine.parallel import TensorParallel


class MixtralForCausalLM(LlamaForCausalLM):
    @classmethod
    def mlp(cls, cfg: ModelConfig, layer: int, tp: TensorParallel) -> nn.Module:
        return SparseMoE(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_experts,
            cfg.experts_per_token,
            cfg.hidden_act,
            tp,
            renormalize=True,
            expert_names=("w1", "w3", "w2"),
        )

    def checkpoint_map(self) -> dict[str, Target]:
        out = with_experts(self, super().checkpoint_map())
        return {name.replace(".mlp.", ".block_sparse_moe."): t for name, t in out.items()}
