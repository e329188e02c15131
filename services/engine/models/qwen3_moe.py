"""Qwen3-MoE: Qwen3's attention (an RMS norm over each head of q and of k) and, on its sparse
layers, a mixture of experts: the top `num_experts_per_tok` of `num_experts`, their softmax
probabilities renormalised when `norm_topk_prob`. The layers in `mlp_only_layers`, and those
`decoder_sparse_step` skips, keep a dense gated MLP of `intermediate_size`; the experts'
width is `moe_intermediate_size` (the ModelConfig's intermediate_size)."""

from __future__ import annotations

from torch import nn

from services.common.errors import UnsupportedModel
from services.common.model_config import ModelConfig
from services.engine.models.base import Target
from services.engine.models.layers import GatedMLP
from services.engine.models.llama import Qwen3ForCausalLM
from services.engine.models.moe import SparseMoE, with_experts
from services.engine.parallel import TensorParallel


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @classmethod
    def mlp(cls, cfg: ModelConfig, layer: int, tp: TensorParallel) -> nn.Module:
        raw = cfg.raw
        if layer in cfg.sparse_layers:
            return SparseMoE(
                cfg.hidden_size,
                cfg.intermediate_size,
                cfg.num_experts,
                cfg.experts_per_token,
                cfg.hidden_act,
                tp,
                renormalize=bool(raw.get("norm_topk_prob", False)),
                weights_in_model_dtype=True,
            )
        dense = int(raw["intermediate_size"])
        if dense % tp.world_size:
            raise UnsupportedModel(
                f"tensor parallelism tp={tp.world_size} does not divide the dense layers' "
                f"intermediate_size ({dense}); choose a tp that divides it"
            )
        return GatedMLP(cfg.hidden_size, dense, cfg.biases.mlp, cfg.hidden_act, tp)

    def checkpoint_map(self) -> dict[str, Target]:
        return with_experts(self, super().checkpoint_map())
