"""Sampling: seeds reproduce, filters do what they say, draws follow the distribution."""

from __future__ import annotations

import torch

from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.sampler import SamplingBatch, sample

PROMPT = [0, 100, 200, 300, 400]


def batch(b: int, temperature=1.0, top_k=0, top_p=1.0, uniform=None) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((b,), temperature),
        top_k=torch.full((b,), top_k, dtype=torch.int64),
        top_p=torch.full((b,), top_p),
        uniform=uniform if uniform is not None else torch.rand(b).clamp(min=1e-6),
        all_greedy=temperature == 0,
        any_top_k=top_k > 0,
        any_top_p=top_p < 1,
    )


def test_seeded_sampling_is_reproducible_and_seeds_differ(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64))

    def run(seed: int) -> list[int]:
        p = SamplingParams(max_tokens=32, temperature=1.0, seed=seed, ignore_eos=True)
        return engine.generate([PROMPT], p)[0].token_ids

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_a_seeded_request_gets_the_same_tokens_whatever_shares_its_batch(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=128))
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    alone = engine.generate([PROMPT], seeded)[0].token_ids
    others = [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=1.5, top_k=5, seed=3, ignore_eos=True),
    ]
    together = engine.generate([[0, 7, 8], PROMPT, [0, 9] * 20], [others[0], seeded, others[1]])
    assert together[1].token_ids == alone


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = torch.randn(16, 500)
    greedy = logits.argmax(-1)
    assert torch.equal(sample(logits, batch(16, temperature=1.0, top_k=1)), greedy)
    assert torch.equal(sample(logits, batch(16, temperature=1.0, top_p=1e-6)), greedy)
    assert torch.equal(sample(logits, batch(16, temperature=0.0)), greedy)


def test_samples_follow_softmax_and_filters_exclude_the_tail():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 20000
    rows = logits.expand(n, -1).contiguous()
    probs = torch.softmax(logits[0] / 0.7, -1)
    counts = torch.bincount(sample(rows, batch(n, temperature=0.7)), minlength=6) / n
    assert (counts - probs).abs().max() < 0.015
    top2 = torch.bincount(sample(rows, batch(n, temperature=0.7, top_k=2)), minlength=6)
    assert top2[2:].sum() == 0 and top2[:2].min() > 0
    # top_p 0.8 at T=1: keeps the smallest prefix whose mass reaches 0.8 ({0, 1, 2}).
    p = torch.softmax(logits[0], -1)
    kept = int((p.sort(descending=True).values.cumsum(0) < 0.8).sum()) + 1
    nucleus = torch.bincount(sample(rows, batch(n, top_p=0.8)), minlength=6)
    assert nucleus[kept:].sum() == 0 and nucleus[:kept].min() > 0
    renorm = p[:kept] / p[:kept].sum()
    assert (nucleus[:kept] / n - renorm).abs().max() < 0.015
