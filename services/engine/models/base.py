"""What the engine runs, whatever the family: a causal LM over packed tokens and a paged cache.

A family's model is built for one tensor-parallel rank from its ModelConfig, on the meta device;
the loader (services/engine/weights.py) allocates it on its device, calls `init_buffers`, ties
its embeddings, and fills it from the checkpoint through `checkpoint_map`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from services.common.model_config import ModelConfig
from services.engine.attention import AttentionContext, AttentionSpec
from services.engine.parallel import TensorParallel
from services.engine.rope import attention_factor, cos_sin, inverse_frequencies


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: our parameter `param`, its fused part `part` (None:
    the checkpoint tensor holds every part), under `index` of a stacked parameter (experts)."""

    param: str
    part: int | None = None
    index: int | None = None


class CausalLM(nn.Module):
    """The engine's view of a model: `forward` (tokens -> final hidden states, KV written to
    the cache), `logits`, one AttentionSpec per layer, and the checkpoint's tensor names."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.attention_specs = [
            AttentionSpec(scale=cfg.head_dim**-0.5, window=cfg.window(i))
            for i in range(cfg.num_layers)
        ]
        self.inv_freq: torch.Tensor | None = None
        self.rope_scale = 1.0  # what cos and sin are multiplied by (yarn's attention factor)

    def init_buffers(self, device: torch.device) -> None:
        """Buffers computed, not loaded (after the model leaves the meta device)."""
        if self.config.rope is not None:
            self.inv_freq = inverse_frequencies(self.config.rope, self.config.head_dim).to(device)
            self.rope_scale = attention_factor(self.config.rope)

    def rotary(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin of each position, (T, 1, head_dim) each; None without rotary positions."""
        if self.inv_freq is None:
            return None
        return cos_sin(self.inv_freq, positions, dtype, self.rope_scale)

    embedding = "model.embed_tokens.weight"  # the input embedding's parameter

    def tied(self) -> list[tuple[str, str]]:
        """(ours, the parameter it shares) pairs: lm_head and the input embedding, if tied."""
        return [("lm_head.weight", self.embedding)] if self.config.tie_word_embeddings else []

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The input embedding of the tokens (T, hidden)."""
        return self.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionContext,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """input_ids, positions (T,) -> final hidden states (T, hidden). `on_layer(i)` is
        called once layer i has run (its KV is in the cache). This one serves the families laid
        out as Llama (model.embed_tokens, model.layers taking (x, rotary, attn), model.norm)."""
        x = self.embed(input_ids)  # (T, hidden)
        rotary = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rotary, attn)
            if on_layer is not None:
                on_layer(i)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (N, vocab) float32 logits."""
        return self.lm_head(hidden).float()

    def checkpoint_map(self) -> dict[str, Target]:
        """Every tensor a checkpoint of this model holds -> where it goes. By default each of
        our parameters is the checkpoint tensor of the same name, and a fused projection's
        parts are the modules it was fused from (`packed_from`)."""
        out: dict[str, Target] = {}
        tied = {ours for ours, _ in self.tied()}
        for module_name, module in self.named_modules():
            packed = getattr(module, "packed_from", None)
            for attr, _ in module.named_parameters(recurse=False):
                name = f"{module_name}.{attr}" if module_name else attr
                if name in tied:
                    continue
                if packed is None:
                    out[name] = Target(name)
                    continue
                prefix = module_name.rsplit(".", 1)[0]
                for part, source in enumerate(packed):
                    out[f"{prefix}.{source}.{attr}"] = Target(name, part)
        return out
