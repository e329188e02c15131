"""Paged KV and continuous batching change nothing about the tokens a request gets."""

from __future__ import annotations

import torch

from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 120, (n,), generator=gen).tolist()
    return [torch.randint(2, 900, (k,), generator=gen).tolist() for k in lengths]


def solo(path, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    engine = LLMEngine(path, EngineConfig(num_blocks=64))
    return engine.generate([prompt], params)[0].token_ids


def fragment(engine: LLMEngine) -> None:
    """Leave every other block of the pool taken, so new sequences get scattered blocks."""
    blocks = engine.pool.allocate(engine.pool.num_blocks)
    engine.pool.free(blocks[::2])
    engine._fragment_holder = blocks[1::2]  # keep the odd blocks for the engine's lifetime


def test_scattered_blocks_and_mixed_lengths_equal_one_at_a_time(tiny_model):
    ps = prompts(8)
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=400, block_size=4))
    fragment(engine)
    runs = []
    original = engine.runner.decode

    def spy(seqs):
        runs.extend(len(s.block_table.runs) for s in seqs)
        return original(seqs)

    engine.runner.decode = spy
    batched = engine.generate(ps, GREEDY)
    assert min(runs) > 1, "some sequence had contiguous blocks; the test lost its point"
    for p, res in zip(ps, batched, strict=True):
        assert res.token_ids == solo(tiny_model, p)


def test_sequences_joining_and_leaving_mid_batch_change_nothing(tiny_model):
    ps = prompts(6, seed=1)
    lengths = [5, 30, 12, 24, 3, 18]
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=128, block_size=8))
    ids, joined = [], 0
    outputs: dict[str, list[int]] = {}
    step = 0
    while joined < len(ps) or engine.has_unfinished():
        # A new request joins every third step while older ones are decoding and leaving.
        if joined < len(ps) and step % 3 == 0:
            params = SamplingParams(max_tokens=lengths[joined], temperature=0.0, ignore_eos=True)
            ids.append(engine.add_request(ps[joined], params))
            joined += 1
        for o in engine.step():
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        step += 1
    for rid, p, n in zip(ids, ps, lengths, strict=True):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        assert outputs[rid] == solo(tiny_model, p, params)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_preempted_sequences_recompute_to_the_same_tokens(tiny_model):
    ps = prompts(6, seed=2)
    # 24 blocks of 8 tokens cannot hold six sequences of up to ~150 tokens: decode must preempt.
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=24, block_size=8))
    preempted = []
    original = engine.running.reserve_next_slots

    def spy():
        out = original()
        preempted.extend(out)
        return out

    engine.running.reserve_next_slots = spy
    results = engine.generate(ps, GREEDY)
    assert preempted, "the pool was large enough; the test did not exercise preemption"
    for p, res in zip(ps, results, strict=True):
        assert res.token_ids == solo(tiny_model, p)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_abort_frees_blocks_wherever_the_request_is(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=8))
    running = engine.add_request(prompts(1)[0], GREEDY)
    engine.step()  # prefill: now it holds blocks
    waiting = engine.add_request([5, 6, 7], GREEDY)
    assert engine.pool.num_used > 0
    assert engine.abort(running) and engine.abort(waiting)
    assert not engine.abort(running)
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.has_unfinished()


def test_prefill_batches_respect_the_token_budget(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=256, max_batch_tokens=64))
    sizes = []
    original = engine.runner.prefill

    def spy(seqs, on_layer=None):
        sizes.append([s.num_tokens for s in seqs])
        return original(seqs, on_layer)

    engine.runner.prefill = spy
    ps = [[3] * 20, [4] * 30, [5] * 30, [6] * 100, [7] * 10]
    engine.generate(ps, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    # 20+30 fit in 64; 30 starts the next batch; 100 > L_m runs alone; then 10.
    assert sizes == [[20, 30], [30], [100], [10]]
