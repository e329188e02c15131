"""Sampling: seeds reproduce, filters do what they say, draws follow the distribution."""

from __future__ import annotations

import torch

from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.sampler import SamplingBatch, apply_min_p, apply_penalties, sample

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


def reference_penalties(logits, counts, prompt, presence, frequency, repetition):
    """The penalties token by token, as vLLM's docs state them (a loop, no tensor tricks)."""
    out = logits.clone()
    for r in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            x = float(logits[r, t])
            n = int(counts[r, t])
            if n > 0 or bool(prompt[r, t]):
                rp = float(repetition[r])
                x = x / rp if x > 0 else x * rp
            x -= float(frequency[r]) * n
            x -= float(presence[r]) * (n > 0)
            out[r, t] = x
    return out


def test_penalties_equal_a_token_by_token_reference_on_a_mixed_batch():
    gen = torch.Generator().manual_seed(5)
    rows, vocab = 6, 40
    logits = torch.randn(rows, vocab, generator=gen) * 3
    counts = torch.randint(0, 4, (rows, vocab), generator=gen, dtype=torch.int32)
    counts[torch.rand(rows, vocab, generator=gen) < 0.6] = 0
    prompt = torch.rand(rows, vocab, generator=gen) < 0.3
    # Per row: off, each penalty alone, all together, negative ones (they reward repeats).
    presence = torch.tensor([0.0, 0.7, 0.0, 0.0, 1.5, -2.0])
    frequency = torch.tensor([0.0, 0.0, 0.4, 0.0, 2.0, -0.5])
    repetition = torch.tensor([1.0, 1.0, 1.0, 1.7, 1.2, 0.5])
    got = apply_penalties(
        logits, counts, prompt, presence=presence, frequency=frequency, repetition=repetition
    )
    want = reference_penalties(logits, counts, prompt, presence, frequency, repetition)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert torch.equal(got[0], logits[0])  # a row with every penalty off is untouched
    assert not torch.allclose(got[1:], logits[1:])


def test_repetition_penalty_equals_transformers_processor():
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 50, generator=gen) * 2
    ids = torch.randint(0, 50, (3, 12), generator=gen)  # prompt 8 + output 4 per row
    counts = torch.zeros(3, 50, dtype=torch.int32)
    prompt = torch.zeros(3, 50, dtype=torch.bool)
    for r in range(3):
        prompt[r, ids[r, :8]] = True
        counts[r].index_add_(0, ids[r, 8:], torch.ones(4, dtype=torch.int32))
    got = apply_penalties(
        logits,
        counts,
        prompt,
        presence=torch.zeros(3),
        frequency=torch.zeros(3),
        repetition=torch.full((3,), 1.3),
    )
    want = RepetitionPenaltyLogitsProcessor(1.3)(ids, logits.clone())
    assert torch.equal(got, want)


def test_min_p_equals_transformers_warper_row_by_row():
    from transformers import MinPLogitsWarper

    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 64, generator=gen) * 2
    min_p = torch.tensor([0.0, 0.05, 0.3, 1.0])
    got = apply_min_p(logits, min_p)
    for r, p in enumerate(min_p.tolist()):
        want = MinPLogitsWarper(p)(None, logits[r : r + 1].clone())[0] if p else logits[r]
        assert torch.equal(got[r], want)
    assert torch.isinf(got[3]).sum() == 63  # min_p 1 keeps only the most likely token


def test_sampled_tokens_respect_min_p():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]])
    n = 5000
    rows = logits.expand(n, -1).contiguous()
    b = batch(n, temperature=1.0)
    b.min_p = torch.full((n,), 0.3)
    drawn = torch.bincount(sample(rows.clone(), b), minlength=6)
    p = torch.softmax(logits[0], -1)
    kept = p >= 0.3 * p.max()  # {0, 1, 2}
    assert drawn[~kept].sum() == 0 and drawn[kept].min() > 0


def test_seeded_sampling_with_min_p_repeats_and_ignores_the_batch(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=128))
    seeded = SamplingParams(max_tokens=24, temperature=1.2, min_p=0.1, seed=4, ignore_eos=True)
    unfiltered = SamplingParams(max_tokens=24, temperature=1.2, seed=4, ignore_eos=True)
    alone = engine.generate([PROMPT], seeded)[0].token_ids
    assert engine.generate([PROMPT], seeded)[0].token_ids == alone
    assert engine.generate([PROMPT], unfiltered)[0].token_ids != alone  # min_p did something
    others = [
        SamplingParams(max_tokens=20, temperature=0.0, presence_penalty=1.0, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, min_p=0.5, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=1.0, seed=8, ignore_eos=True),
    ]
    prompts = [[0, 7, 8], PROMPT, [0, 9] * 20, [0, 5]]
    together = engine.generate(prompts, [others[0], seeded, others[1], others[2]])
    assert together[1].token_ids == alone


def test_token_counts_follow_the_output_step_by_step(tiny_model):
    """The decode batch's counts are kept incrementally: after every step each penalized
    sequence's row equals a fresh count of its output (and its prompt mask its prompt)."""
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=128))
    counts = engine.runner.token_counts
    vocab = engine.model_config.vocab_size
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, frequency_penalty=-1.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),  # no row
        SamplingParams(max_tokens=20, temperature=1.0, seed=1, repetition_penalty=0.8),
    ]
    prompts = [PROMPT, [0, 3], [0, 9] * 5]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    seqs = [engine.sequence(i) for i in ids]
    while engine.has_unfinished():
        engine.step()
        for seq in engine.running.seqs:
            if not seq.params.penalized:
                assert seq.counts_row is None
                continue
            out = torch.bincount(torch.tensor(seq.output_ids), minlength=vocab)
            assert torch.equal(counts.output[seq.counts_row].long(), out)
            prompt = torch.zeros(vocab, dtype=torch.bool)
            prompt[seq.token_ids[: seq.num_prompt_tokens]] = True
            assert torch.equal(counts.prompt[seq.counts_row], prompt)
    assert counts.rows_in_use == 0  # every row given back
    assert len(seqs[0].output_ids) == 30
