"""Rotary position embeddings with the scalings Llama-family checkpoints use.

Frequencies are computed the way Hugging Face `transformers` computes them (float32 throughout),
so that our logits match the reference to float rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from services.common.model_config import RopeConfig


def _default(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    return inv_freq


def _linear(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    return inv_freq / rope.factor


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


SCALINGS: dict[str, Callable[[torch.Tensor, RopeConfig], torch.Tensor]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
}


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """(head_dim / 2,) float32 angular frequencies, scaled as the config asks."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    return SCALINGS[rope.type](inv_freq, rope)


def cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for each position: two (T, 1, head_dim) tensors, broadcast over heads."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim / 2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, head_dim)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, heads, head_dim) by its positions (the rotate-half layout of Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
