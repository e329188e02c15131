"""The layers the model families share, each built as one tensor-parallel rank's share.

Megatron-style: a `ColumnLinear` holds this rank's rows of its output (of each fused part: q, k
and v, or gate and up); a `RowLinear` holds its columns of the input, and an all-reduce sums the
ranks' partial outputs (its bias added once, after the sum). The embedding and the LM head hold
ceil(vocab / tp) rows a rank (the last rank's tail is zero padding): the embedding sums its
ranks' lookups with an all-reduce, the LM head gathers every rank's logits. With tp == 1 every
layer is the plain one and no collective is called.

How a checkpoint fills a layer is said by the layer itself, next to its shapes: `splits` names,
per parameter, the `Split` between ranks (absent: every rank holds all of it), and a fused
projection's `packed_from` the checkpoint modules it was fused from (absent: the checkpoint
holds it fused too, as Phi-3's qkv_proj). services/engine/weights.py reads only that.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from services.common.model_config import ModelConfig
from services.engine.attention import AttentionContext
from services.engine.gemm import Linear, rows_linear
from services.engine.parallel import TensorParallel
from services.engine.rope import apply_rope

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True)
class Split:
    """A parameter divided between `world` ranks along `dim`: it holds, of each fused part of
    full size `parts[i]`, ceil(parts[i] / world) entries (rank `rank`'s, zero-padded at the end
    of the last rank's vocabulary)."""

    dim: int
    parts: tuple[int, ...]
    rank: int = 0
    world: int = 1

    def per(self, part: int) -> int:
        return -(-self.parts[part] // self.world)

    def held(self, part: int) -> tuple[int, int]:
        """(start in the full part, length) of the entries of `part` this rank holds."""
        full, per = self.parts[part], self.per(part)
        start = min(self.rank * per, full)
        return start, max(0, min(per, full - start))

    def offset(self, part: int) -> int:
        """Where `part` starts in this rank's parameter along `dim`."""
        return sum(self.per(p) for p in range(part))


class ColumnLinear(Linear):
    """y = x @ W_r^T + b_r: this rank's rows of each fused part of the output."""

    def __init__(
        self,
        in_features: int,
        parts: Sequence[int],
        bias: bool,
        tp: TensorParallel,
        packed_from: tuple[str, ...] | None = None,
    ) -> None:
        split = Split(0, tuple(parts), tp.rank, tp.world_size)
        self.sizes = [split.per(i) for i in range(len(parts))]
        super().__init__(in_features, sum(self.sizes), bias=bias)
        self.splits = {"weight": split, "bias": split}
        self.packed_from = packed_from


class RowLinear(nn.Module):
    """y = all_reduce(x_r @ W_r^T) + b: this rank's slice of the input features (columns of
    W); the bias is replicated and added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel):
        super().__init__()
        split = Split(1, (in_features,), tp.rank, tp.world_size)
        self.weight = nn.Parameter(torch.empty(out_features, split.per(0)))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.splits = {"weight": split}
        self.tp = tp
        self.gemm_plan: dict[int, int] = {}  # see services.engine.gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(rows_linear(x, self.weight, self.gemm_plan))  # (T, out)
        return y if self.bias is None else y + self.bias


class VocabEmbedding(nn.Module):
    """Rank r holds its vocabulary rows; ids outside them give zeros, and the all-reduce sums
    one real row with zeros, exactly."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel) -> None:
        super().__init__()
        split = Split(0, (vocab_size,), tp.rank, tp.world_size)
        self.start, self.num_rows = split.held(0)
        self.weight = nn.Parameter(torch.empty(split.per(0), dim))
        self.splits = {"weight": split}
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # (T, dim)
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0.0))


class LMHead(nn.Module):
    """Rank r computes the logits of its vocabulary rows; an all-gather gives every rank all."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel) -> None:
        super().__init__()
        split = Split(0, (vocab_size,), tp.rank, tp.world_size)
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(split.per(0), dim))
        self.splits = {"weight": split}
        self.tp = tp
        self.gemm_plan: dict[int, int] = {}  # see services.engine.gemm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(rows_linear(hidden, self.weight, self.gemm_plan))
        return logits[:, : self.vocab_size]  # drop the padding rows


class RMSNorm(nn.Module):
    """x / rms(x) * weight, in float32. `offset` 1: the weight is stored as (scale - 1), and
    the product is taken in float32 before the cast back (Gemma)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (x * (self.offset + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    """Self-attention over the paged cache: fused q/k/v (this rank's heads), rotary positions
    unless the family learns them, optional per-head RMS norms of q and k before the rotation
    (Qwen3), and the output projection. How scores are scaled, windowed and capped is the
    layer's AttentionSpec, which the AttentionContext holds."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer: int,
        tp: TensorParallel,
        qkv_packed_from: tuple[str, ...] | None = ("q_proj", "k_proj", "v_proj"),
        qk_norm: bool = False,
        o_name: str = "o_proj",
    ) -> None:
        super().__init__()
        n = tp.world_size
        self.layer = layer
        self.num_heads, self.num_kv_heads = cfg.num_heads // n, cfg.num_kv_heads // n
        self.head_dim = d = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = ColumnLinear(
            cfg.hidden_size,
            (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d),
            cfg.biases.qkv,
            tp,
            qkv_packed_from,
        )
        self.o_name = o_name
        setattr(self, o_name, RowLinear(cfg.num_heads * d, cfg.hidden_size, cfg.biases.o, tp))
        self.q_norm = RMSNorm(d, cfg.norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, cfg.norm_eps) if qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None,
        attn: AttentionContext,
    ) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # (T, H, D)
        k = k.view(T, self.num_kv_heads, self.head_dim)  # (T, KV, D)
        v = v.view(T, self.num_kv_heads, self.head_dim)  # (T, KV, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None:
            cos, sin = rotary
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attn(self.layer, q, k, v)  # (T, H, D)
        return getattr(self, self.o_name)(o.reshape(T, self.q_size))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (Llama), GeGLU (Gemma)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool,
        act: str,
        tp: TensorParallel,
        packed_from: tuple[str, ...] | None = ("gate_proj", "up_proj"),
    ) -> None:
        super().__init__()
        self.gate_up_proj = ColumnLinear(hidden, (intermediate,) * 2, bias, tp, packed_from)
        self.intermediate = self.gate_up_proj.sizes[0]
        self.down_proj = RowLinear(intermediate, hidden, bias, tp)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)
