"""Decode attention over paged KV against torch SDPA on the gathered context."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine.attention import (
    AttentionMetadata,
    AttentionSpec,
    TorchAttention,
    flash_available,
)

H, KV, D, BS = 6, 2, 16, 4


def reference(q, k_cache, v_cache, spans):
    """SDPA over each sequence's context gathered into one contiguous tensor."""
    out = []
    for i, seq_spans in enumerate(spans):
        k = torch.cat([k_cache[a : a + n] for a, n in seq_spans])  # (L, KV, D)
        v = torch.cat([v_cache[a : a + n] for a, n in seq_spans])
        o = F.scaled_dot_product_attention(
            q[i][None, :, None],  # (1, H, 1, D)
            k.transpose(0, 1)[None],  # (1, KV, L, D)
            v.transpose(0, 1)[None],
            enable_gqa=True,
        )
        out.append(o[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_single_and_multi_run_contexts_like_sdpa(dtype):
    gen = torch.Generator().manual_seed(0)
    slots = 64 * BS
    k_cache = torch.randn(slots, KV, D, generator=gen).to(dtype)
    v_cache = torch.randn(slots, KV, D, generator=gen).to(dtype)
    spans = [
        [(0, 1)],  # one token
        [(8, 37)],  # one run, partial last block
        [(100, 8), (40, 12), (200, 3)],  # three runs
        [(160, 4), (164, 1)],  # adjacent runs
    ]
    q = torch.randn(len(spans), H, D, generator=gen).to(dtype)
    meta = AttentionMetadata(slots=torch.zeros(0, dtype=torch.long), is_prefill=False, spans=spans)
    got = TorchAttention(H, KV).decode(q, k_cache, v_cache, meta, AttentionSpec(D**-0.5))
    want = reference(q.float(), k_cache.float(), v_cache.float(), spans)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got.float() - want).abs().max().item() < tol


@pytest.mark.skipif(not flash_available(torch.device("cuda")), reason="needs CUDA and flash-attn")
def test_flash_backend_matches_torch_backend_on_cuda(model_factory):
    from services.common.sampling import SamplingParams
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine

    path = model_factory("llama-bf16-cuda", dtype="bfloat16")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7] * k for k in (1, 10, 40)]
    outs = {}
    for backend in ("torch", "flash"):
        cfg = EngineConfig(device="cuda", dtype="bfloat16", attention=backend, block_size=256)
        outs[backend] = [c.token_ids for c in LLMEngine(path, cfg).generate(prompts, params)]
    agree = sum(
        a == b
        for x, y in zip(outs["torch"], outs["flash"], strict=True)
        for a, b in zip(x, y, strict=True)
    )
    assert agree >= 0.9 * sum(len(x) for x in outs["torch"])
