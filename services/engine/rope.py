"""Rotary position embeddings with the scalings checkpoints use: linear, llama3 and yarn.

Frequencies are computed the way Hugging Face `transformers` computes them (float32 throughout),
so that our logits match the reference to float rounding. YaRN (Peng et al. 2023) also scales
the rotation's magnitude: `attention_factor` multiplies cos and sin in every family, and
multi-head latent attention (DeepSeek) multiplies its softmax scale by `softmax_mscale`.
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


def _yarn(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    dim = 2 * inv_freq.shape[0]
    base, old_len = rope.theta, rope.original_max_position_embeddings

    def dimension(rotations: float) -> float:
        """The dimension whose wavelength fits `rotations` times in the original context."""
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(rope.beta_fast), dimension(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # Dimensions below `low` (many rotations in the original context) keep their frequency,
    # those above `high` are interpolated by `factor`, the band between blends the two.
    extrapolated = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    interpolated = 1.0 / (rope.factor * pos_freqs)  # transformers' form, to the last bit
    return interpolated * (1 - extrapolated) + inv_freq * extrapolated


SCALINGS: dict[str, Callable[[torch.Tensor, RopeConfig], torch.Tensor]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `factor` times longer: 0.1 m ln(factor) + 1."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by: 1 but for yarn (its `attention_factor`, or the
    ratio of the mscales when both are set, else yarn_mscale(factor))."""
    if rope.type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def softmax_mscale(rope: RopeConfig | None) -> float:
    """What multi-head latent attention multiplies its softmax scale by: yarn's
    mscale(factor, mscale_all_dim) squared (DeepSeek's reference code, and transformers'
    yarn_apply_mscale), 1 otherwise."""
    if rope is None or rope.type != "yarn" or not rope.mscale_all_dim:
        return 1.0
    return yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """(head_dim / 2,) float32 angular frequencies, scaled as the config asks."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    return SCALINGS[rope.type](inv_freq, rope)


def cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for each position, times `scale` (attention_factor): two (T, 1, head_dim)
    tensors, broadcast over heads."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, head_dim / 2)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, head_dim)
    if scale == 1.0:
        return emb.cos().to(dtype), emb.sin().to(dtype)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (T, heads, head_dim) by its positions (the rotate-half layout of Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
