"""Attention over the paged KV cache: flash-attn on CUDA when it imports, torch otherwise.

Both backends compute the same thing. Prefill attends within each prompt (causal) using the K and
V just computed; decode attends from each sequence's one new token over its cached context. Every
new token's K and V are first written into the cache at its slot.

A prefill whose prompts start from a cached prefix (prefix cache) runs only the uncached tokens:
their queries attend over the whole context, read back from the cache (`kv_slots`), causal with
the mask aligned bottom-right (query i of L sees keys up to S - L + i of S). The torch backend
builds that mask; flash-attn's varlen kernel aligns a causal mask bottom-right itself when
seqlen_q != seqlen_k (flash-attn >= 2.1).

What differs between model families is one `AttentionSpec` per layer: the score scale, a
sliding window (each query sees itself and the window - 1 keys before it) and a soft cap of the
scores (cap * tanh(score / cap), Gemma 2). The KV cache keeps every token either way; a
sliding layer only reads the window's part of it.

Multi-head latent attention (DeepSeek-V2) caches one latent vector per token instead of K and V
(`AttentionContext.latent`), and attends in the absorbed form: the latent is the one KV head
every query head shares, and the values are its first entries, so the same backends serve it
(docs/engine.md, "The latent KV cache").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.common.errors import InvalidRequest
from services.engine.kv_cache import KvCache


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer attends: scores scaled by `scale`, a sliding `window` (None: the whole
    context), scores soft-capped at `softcap` (None: not capped)."""

    scale: float
    window: int | None = None
    softcap: float | None = None


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit, built once per step and shared by every layer."""

    slots: torch.Tensor  # (T,) int64 cache slot of each new token's K and V
    is_prefill: bool
    # prefill: token offsets of each sequence in the packed batch, len = num_seqs + 1
    cu_seqlens: list[int] | None = None
    max_seqlen: int = 0
    # decode, torch backend: per sequence the (first slot, length) spans of its context
    spans: list[list[tuple[int, int]]] | None = None
    # decode, flash backend: (B, max_blocks) int32 block tables and (B,) int32 context lengths
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    cu_seqlens_t: torch.Tensor | None = None  # prefill, flash backend: cu_seqlens on device
    # prefill over a cached prefix: (S,) int64 cache slots of every sequence's whole context
    # (cached and new tokens), packed, with its offsets per sequence (None: the keys are the
    # new tokens, cu_seqlens)
    kv_slots: torch.Tensor | None = None
    cu_seqlens_k: list[int] | None = None
    max_seqlen_k: int = 0
    cu_seqlens_k_t: torch.Tensor | None = None  # flash backend: cu_seqlens_k on device


class TorchAttention:
    """Attention with torch ops: SDPA for prefill, in-place reads of cache runs for decode."""

    name = "torch"
    needs_block_tables = False

    def __init__(self, num_heads: int, num_kv_heads: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        """q (T, H, D), packed prompts; k (S, KV, D) and v (S, KV, Dv), their keys and values
        (S = T, or each sequence's whole context with a cached prefix: cu_seqlens_k) ->
        (T, H, Dv)."""
        out = q.new_empty(*q.shape[:2], v.shape[-1])
        cu = meta.cu_seqlens
        cu_k = meta.cu_seqlens_k or cu
        gqa = self.group > 1
        for (a, b), (ka, kb) in zip(itertools.pairwise(cu), itertools.pairwise(cu_k), strict=True):
            L, S = b - a, kb - ka
            # Causal from the end: query i (position S - L + i) sees keys 0 .. S - L + i, and
            # with a window only the last `window` of them.
            mask = None
            if L != S or (spec.window is not None and spec.window < S) or spec.softcap:
                mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)
                if spec.window is not None:
                    mask &= torch.ones_like(mask).triu(S - L - spec.window + 1)
            qs, ks, vs = (x.transpose(0, 1)[None] for x in (q[a:b], k[ka:kb], v[ka:kb]))
            if spec.softcap:
                o = _capped(qs, ks, vs, mask, spec, self.group)[0]
            else:
                # 4-D inputs: with 3-D ones torch picks the slow math kernel on CPU.
                o = F.scaled_dot_product_attention(
                    qs,  # (1, H, L, D)
                    ks,  # (1, KV, S, D)
                    vs,
                    attn_mask=mask,
                    is_causal=mask is None,
                    scale=spec.scale,
                    enable_gqa=gqa,
                )[0]
            out[a:b] = o.transpose(0, 1)
        return out

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        """q (B, H, D), one token per sequence; k_cache (slots, KV, D), v_cache (slots, KV,
        Dv) -> (B, H, Dv).

        Each sequence's context is read in place from its runs of blocks: no gather, no padding.
        The query heads that share a KV head are folded into the query axis, (KV, G, D), so one
        matmul per run serves the whole group.
        """
        B = q.shape[0]
        qg = (q * spec.scale).view(B, self.num_kv_heads, self.group, -1)  # (B, KV, G, D)
        out = qg.new_empty(*qg.shape[:3], v_cache.shape[-1])  # (B, KV, G, Dv)
        exact = q.dtype == torch.float32  # else softmax in float32, then back
        cap = spec.softcap
        # Few ops per sequence: this loop runs layers x sequences times per step.
        for i, spans in enumerate(meta.spans):
            if spec.window is not None:
                spans = _last(spans, spec.window)
            if len(spans) == 1:
                a, n = spans[0]
                s = torch.bmm(qg[i], k_cache[a : a + n].permute(1, 2, 0))  # (KV, G, L)
                if cap:
                    s = torch.tanh(s / cap) * cap
                p = torch.softmax(s, -1) if exact else _softmax32(s)
                torch.bmm(p, v_cache[a : a + n].transpose(0, 1), out=out[i])  # (KV, G, D)
            else:
                s = torch.cat(
                    [torch.bmm(qg[i], k_cache[a : a + n].permute(1, 2, 0)) for a, n in spans], -1
                )
                if cap:
                    s = torch.tanh(s / cap) * cap
                p = torch.softmax(s, -1) if exact else _softmax32(s)
                o = out[i].zero_()
                off = 0
                for a, n in spans:
                    o.add_(torch.bmm(p[..., off : off + n], v_cache[a : a + n].transpose(0, 1)))
                    off += n
        return out.view(B, self.num_heads, -1)


class FlashAttention(TorchAttention):
    """flash-attn kernels on CUDA: varlen for prefill, paged KV for decode.

    flash-attn reads paged KV only for block sizes that are multiples of 256; with smaller blocks
    decode falls back to the torch backend's in-place reads, which compute the same thing.
    """

    name = "flash"

    def __init__(self, num_heads: int, num_kv_heads: int, block_size: int) -> None:
        super().__init__(num_heads, num_kv_heads)
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._paged = flash_attn_with_kvcache
        self.block_size = block_size
        self.needs_block_tables = block_size % 256 == 0

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        return self._varlen(
            q,
            k,
            v,
            cu_seqlens_q=meta.cu_seqlens_t,
            cu_seqlens_k=meta.cu_seqlens_t if meta.kv_slots is None else meta.cu_seqlens_k_t,
            max_seqlen_q=meta.max_seqlen,
            max_seqlen_k=meta.max_seqlen if meta.kv_slots is None else meta.max_seqlen_k,
            softmax_scale=spec.scale,
            causal=True,  # bottom-right aligned where a cached prefix makes seqlen_k longer
            window_size=_flash_window(spec),
            softcap=spec.softcap or 0.0,
        )

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        if not self.needs_block_tables:
            return super().decode(q, k_cache, v_cache, meta, spec)
        shape = (-1, self.block_size, *k_cache.shape[1:])  # (num_blocks, block_size, KV, D)
        out = self._paged(
            q[:, None],
            k_cache.view(shape),
            v_cache.view(shape),
            cache_seqlens=meta.context_lens,
            block_table=meta.block_tables,
            softmax_scale=spec.scale,
            causal=True,
            window_size=_flash_window(spec),
            softcap=spec.softcap or 0.0,
        )
        return out[:, 0]


def _softmax32(s: torch.Tensor) -> torch.Tensor:
    return torch.softmax(s, -1, dtype=torch.float32).to(s.dtype)


def _capped(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    spec: AttentionSpec,
    group: int,
) -> torch.Tensor:
    """Attention with soft-capped scores, which SDPA cannot do: q (1, H, L, D), k and v
    (1, KV, S, D), mask (L, S) True where a key is seen -> (1, H, L, D)."""
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.matmul(q, k.transpose(-1, -2)) * spec.scale
    s = torch.tanh(s / spec.softcap) * spec.softcap
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1) if q.dtype == torch.float32 else _softmax32(s)
    return torch.matmul(p, v)


def _last(spans: list[tuple[int, int]], window: int) -> list[tuple[int, int]]:
    """The part of a context's (first slot, length) runs holding its last `window` tokens."""
    out: list[tuple[int, int]] = []
    for a, n in reversed(spans):
        if window <= 0:
            break
        take = min(n, window)
        out.append((a + n - take, take))
        window -= take
    return out[::-1]


def _flash_window(spec: AttentionSpec) -> tuple[int, int]:
    return (-1, -1) if spec.window is None else (spec.window - 1, 0)


def flash_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def make_backend(
    choice: str,
    *,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
    latent: bool = False,
) -> TorchAttention:
    """The attention backend for `choice` (auto | torch | flash); `latent`: over a latent KV
    cache (multi-head latent attention), which flash-attn's kernels cannot read."""
    if choice == "flash" and latent:
        raise InvalidRequest(
            "attention 'flash' cannot read a latent KV cache (multi-head latent attention: one "
            "head of kv_lora_rank + qk_rope_head_dim entries, wider than flash-attn's 256); use "
            "--attention auto or torch"
        )
    if choice == "flash" and not flash_available(device):
        raise InvalidRequest("attention 'flash' needs a CUDA device and the flash_attn package")
    use_flash = choice == "flash" or (
        choice == "auto"
        and not latent
        and flash_available(device)
        and dtype in (torch.float16, torch.bfloat16)
    )
    if use_flash:
        return FlashAttention(num_heads, num_kv_heads, block_size)
    return TorchAttention(num_heads, num_kv_heads)


class AttentionContext:
    """What every attention layer of one forward pass needs: cache, metadata, backend, and each
    layer's AttentionSpec."""

    def __init__(
        self,
        cache: KvCache,
        meta: AttentionMetadata,
        backend: TorchAttention,
        specs: list[AttentionSpec],
    ) -> None:
        self.cache = cache
        self.meta = meta
        self.backend = backend
        self.specs = specs

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Store this step's K and V of `layer` in the cache, then attend: (T, H, D)."""
        k_cache, v_cache = self.cache.layer(layer)
        k_cache.index_copy_(0, self.meta.slots, k)
        v_cache.index_copy_(0, self.meta.slots, v)
        if self.meta.is_prefill:
            if self.meta.kv_slots is not None:  # the keys include a cached prefix
                k = k_cache.index_select(0, self.meta.kv_slots)
                v = v_cache.index_select(0, self.meta.kv_slots)
            return self.backend.prefill(q, k, v, self.meta, self.specs[layer])
        return self.backend.decode(q, k_cache, v_cache, self.meta, self.specs[layer])

    def latent(self, layer: int, q: torch.Tensor, latent: torch.Tensor, v_dim: int) -> torch.Tensor:
        """Multi-head latent attention, absorbed: store this step's latent of `layer`, (T, 1,
        Dl), in the cache, then attend with q (T, H, Dl) over each context's latents as the one
        KV head all query heads share, its first `v_dim` entries the values -> (T, H, v_dim)."""
        (cache,) = self.cache.layer(layer)
        cache.index_copy_(0, self.meta.slots, latent)
        spec = self.specs[layer]
        if self.meta.is_prefill:
            if self.meta.kv_slots is not None:  # the context includes a cached prefix
                latent = cache.index_select(0, self.meta.kv_slots)
            return self.backend.prefill(q, latent, latent[..., :v_dim], self.meta, spec)
        return self.backend.decode(q, cache, cache[..., :v_dim], self.meta, spec)
