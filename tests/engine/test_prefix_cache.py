"""The engine's prefix cache: a prompt reuses the KV of its longest cached prefix of full blocks,
computes only the rest, and gets exactly the tokens it would get without the cache."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from services.common.model_spec import PRESETS
from services.common.prefix_hash import block_hashes
from services.common.sampling import SamplingParams
from services.engine.block_pool import BlockPool
from services.engine.config import Emulation, EngineConfig
from services.engine.engine import LLMEngine
from services.engine.kv_events import KvEventLog
from services.engine.presets import create_emulated
from services.engine.sequence import SequenceStatus

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 900, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


BASE = tokens(100, 0)
TAIL = tokens(10, 1)


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY):
    """A request's tokens, alone on the engine, and how many of its tokens were cached."""
    rid = engine.add_request(prompt, params)
    out, cached = [], None
    while engine.has_unfinished():
        for o in engine.step():
            if cached is None:
                cached = o.num_cached_tokens
            out += o.new_token_ids
    assert engine.sequence(rid) is None
    return out, cached


# -- exactness -------------------------------------------------------------------------------


# (prompt, tokens reused) after BASE (100 tokens: 6 full blocks of 16) was served.
SHARING = [
    (BASE[:40] + TAIL, 32),  # the third block differs
    (BASE[:48] + TAIL, 48),  # the shared prefix ends exactly at a block boundary
    (BASE[:64], 48),  # the prompt is a cached prefix: its last block is computed again
    (BASE[:20], 16),
    (BASE, 96),  # the same prompt again
    (TAIL + BASE, 0),
]


def test_greedy_outputs_with_the_cache_equal_those_without(tiny_model):
    on = LLMEngine(tiny_model, EngineConfig(num_blocks=64))
    off = LLMEngine(tiny_model, EngineConfig(num_blocks=64, prefix_cache=False))
    assert run(on, BASE) == (run(off, BASE)[0], 0)
    for prompt, reused in SHARING:
        out, cached = run(on, prompt)
        assert cached == reused, f"prompt of {len(prompt)} tokens"
        assert out == run(off, prompt)[0], f"prompt of {len(prompt)} tokens"
    stats = on.prefix_stats
    assert stats.prompt_tokens_reused == sum(r for _, r in SHARING)
    assert stats.prompt_tokens_computed == len(BASE) + sum(len(p) - r for p, r in SHARING)
    assert off.prefix_stats.prompt_tokens_reused == 0 and off.pool.num_cached == 0


def test_a_prompt_that_hit_the_cache_equals_transformers(model_factory):
    pytest.importorskip("transformers")
    from tests.engine.test_parity_transformers import VARIANTS, hf_greedy, hf_model

    path = model_factory("llama", **VARIANTS["llama"])
    engine = LLMEngine(path, EngineConfig(num_blocks=64))
    hf = hf_model(path)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    run(engine, BASE, params)
    for prompt in (BASE[:48] + TAIL, BASE[:64]):
        out, cached = run(engine, prompt, params)
        assert cached == 48 and out == hf_greedy(hf, prompt, 16)


def test_hits_in_scattered_blocks_of_a_batch_stay_exact(tiny_model):
    """Cached prefixes and new blocks in several runs each, prompts sharing one batch."""
    on = LLMEngine(tiny_model, EngineConfig(num_blocks=200, block_size=4))
    off = LLMEngine(tiny_model, EngineConfig(num_blocks=200, block_size=4, prefix_cache=False))
    blocks = on.pool.allocate(on.pool.num_blocks)
    on.pool.free(blocks[::2])  # every other block taken: every sequence gets scattered blocks
    run(on, BASE[:50])
    runs = []
    original = on.runner.decode

    def spy(seqs):
        runs.extend(len(s.block_table.runs) for s in seqs)
        return original(seqs)

    on.runner.decode = spy
    prompts = [BASE[:30] + TAIL, BASE[:50], TAIL + BASE[:9], BASE[:13]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [c.token_ids for c in on.generate(prompts, params)]
    assert got == [c.token_ids for c in off.generate(prompts, params)]
    assert min(runs) > 1
    assert on.prefix_stats.prompt_tokens_reused == 28 + 48 + 0 + 12


def test_preemption_under_memory_pressure_with_the_cache_stays_exact(tiny_model):
    prompts = [BASE[: 40 + 9 * i] + tokens(5, i) for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=30, block_size=8))
    preempted = []
    original = engine.running.reserve_next_slots

    def spy():
        out = original()
        preempted.extend(out)
        return out

    engine.running.reserve_next_slots = spy
    run(engine, BASE[:40])
    got = [c.token_ids for c in engine.generate(prompts, params)]
    assert preempted, "the pool was large enough; the test did not exercise preemption"
    off = LLMEngine(tiny_model, EngineConfig(num_blocks=64, prefix_cache=False))
    assert got == [c.token_ids for c in off.generate(prompts, params)]
    assert engine.prefix_stats.prompt_tokens_reused > 0
    assert engine.pool.num_free == engine.pool.num_blocks


# -- references and eviction -----------------------------------------------------------------


def test_eviction_is_least_recently_freed_first_and_spares_referenced_blocks():
    pool = BlockPool(8)
    a, b, c = pool.allocate(2), pool.allocate(2), pool.allocate(2)
    for i, block in enumerate(a + b + c):
        assert pool.register(block, 100 + i)
    assert not pool.register(a[0], 999) and not pool.register(pool.allocate(1)[0], 100)
    pool.free(a)
    pool.free(b)
    assert pool.num_free == 5 and pool.num_cached == 6  # c is still referenced
    assert pool.cached_prefix([100, 101, 999]) == a and pool.cached_prefix([999, 100]) == []
    pool.acquire(b[:1])  # b's first block has an owner again
    assert pool.ref_count(b[0]) == 1 and pool.num_free == 4
    pool.allocate(2)  # 1 empty block, and a's last block: a was freed first, its tail first
    assert pool.cached_prefix([100, 101]) == a[:1]
    pool.allocate(2)  # a's first, then b's second: b's first is referenced
    assert pool.cached_prefix([100]) == [] and pool.cached_prefix([102, 103]) == b[:1]
    assert pool.num_evicted == 3 and pool.num_free == 0
    with pytest.raises(ValueError, match="not cached"):
        pool.acquire(a[:1])
    events = pool.events.drain(100, pool.cached_hashes)
    assert set(events.stored) == {102, 104, 105} and set(events.removed) == {100, 101, 103}


def test_blocks_are_shared_by_reference_and_stay_cached_when_requests_end(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=32), detokenize=False)
    engine.add_request(BASE[:40], GREEDY, request_id="a")
    engine.prefill_step(hold=True)
    engine.add_request(BASE[:40] + TAIL, GREEDY, request_id="b")
    (out,) = engine.prefill_step(hold=True)
    a, b = engine.sequence("a").block_table.blocks, engine.sequence("b").block_table.blocks
    assert out.num_cached_tokens == 32 and b[:2] == a[:2] and set(b[2:]).isdisjoint(a)
    assert [engine.pool.ref_count(x) for x in a[:2]] == [2, 2]
    assert engine.pool.num_used == 3 + 2  # a's 3 blocks, b's own 2
    assert engine.release("a") == 3
    assert [engine.pool.ref_count(x) for x in a] == [1, 1, 0]
    assert engine.release("b") == 4
    assert engine.pool.num_free == engine.pool.num_blocks and engine.pool.num_cached == 3


def test_a_cancelled_requests_cached_blocks_stay_valid_and_unpinned(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=8))
    rid = engine.add_request(BASE[:40], SamplingParams(max_tokens=20, temperature=0.0))
    engine.step()  # prefilled: its two full blocks are cached
    assert engine.sequence(rid).status is SequenceStatus.RUNNING
    assert engine.abort(rid)
    assert engine.pool.num_free == engine.pool.num_blocks and engine.pool.num_cached == 2
    off = LLMEngine(tiny_model, EngineConfig(num_blocks=8, prefix_cache=False))
    assert run(engine, BASE[:40] + TAIL) == (run(off, BASE[:40] + TAIL)[0], 32)
    # Unpinned: a request that needs the whole pool evicts them.
    whole = engine.pool.num_blocks * 16 - GREEDY.max_tokens
    engine.generate([tokens(whole, 5)], GREEDY)
    assert engine.pool.num_evicted >= 2 and engine.pool.num_free == engine.pool.num_blocks


def test_a_prompt_prefilled_in_one_batch_with_its_prefix_is_computed_whole(tiny_model):
    """Blocks are cached only once their KV is written: not within the step that writes them."""
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=32), detokenize=False)
    engine.add_request(BASE[:40], GREEDY, request_id="a")
    engine.add_request(BASE[:40], GREEDY, request_id="b")
    outs = engine.prefill_step(hold=True)
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    assert engine.pool.num_cached == 2  # b's copies of the blocks stay private
    engine.abort("a")
    engine.abort("b")
    assert engine.pool.num_free == engine.pool.num_blocks


def test_the_cache_off_registers_nothing(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=32, prefix_cache=False))
    assert run(engine, BASE)[1] == 0 and run(engine, BASE)[1] == 0
    assert engine.pool.num_cached == 0 and engine.kv_events().stored == []


# -- KV events and the salt ------------------------------------------------------------------


def test_kv_events_report_stored_and_evicted_hashes_and_reset_when_they_overflow(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=12), detokenize=False)
    assert engine.block_size == 16
    run(engine, BASE[:40])
    hashes = block_hashes(BASE[:40], 16, engine.cache_salt)
    events = engine.kv_events()
    assert events.stored == hashes and events.removed == [] and not events.reset
    assert engine.kv_events().stored == []  # drained
    run(engine, tokens(180, 7))  # 12 blocks: both evicted, the later one first
    events = engine.kv_events()
    assert events.removed == hashes[::-1] and len(events.stored) == (180 + 7) // 16
    assert engine.prefix_stats.blocks_evicted == 2
    run(engine, tokens(40, 8))
    events = engine.kv_events(max_events=3)  # 2 stored + 2 removed > 3: a reset
    assert events.reset and events.removed == []
    assert events.stored == engine.pool.cached_hashes()[:3]
    assert engine.kv_events() == type(events)()


def test_the_event_log_is_bounded():
    log = KvEventLog(capacity=4)
    for h in range(3):
        log.stored(h)
    log.removed(1)
    log.stored(1)  # net: cached
    assert log.drain(10, list).stored == [0, 1, 2]
    for h in range(5):
        log.stored(h)
    assert log._changes == {}  # overflowed: it keeps nothing
    assert log.drain(10, lambda: [7, 8]).reset


def test_the_salt_changes_with_the_dtype_and_the_weights(tiny_model, tmp_path):
    fast = {"num_blocks": 8, "tune_gemm": False}
    salt = LLMEngine(tiny_model, EngineConfig(**fast)).cache_salt
    assert LLMEngine(tiny_model, EngineConfig(**fast)).cache_salt == salt
    bf16 = LLMEngine(tiny_model, EngineConfig(dtype="bfloat16", **fast)).cache_salt
    assert bf16 != salt
    copy = shutil.copytree(tiny_model, tmp_path / "copy")
    assert LLMEngine(copy, EngineConfig(**fast)).cache_salt == salt  # the same weights
    for f in copy.glob("*.safetensors"):
        os.utime(f, ns=(f.stat().st_mtime_ns, f.stat().st_mtime_ns + 10**9))
    assert LLMEngine(copy, EngineConfig(**fast)).cache_salt != salt
    assert LLMEngine(tiny_model, EngineConfig(block_size=8, **fast)).cache_salt != salt


# -- decode-side reuse -----------------------------------------------------------------------


def copy_kv(src: LLMEngine, src_blocks: list[int], dst: LLMEngine, dst_blocks: list[int]) -> None:
    """What the KV transfer does, as a local copy."""
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        dst.runner.cache.data[:, :, d] = src.runner.cache.data[:, :, s]  # torch or numpy


def handoff(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], rid: str) -> tuple:
    """Prefill on one engine, pull only the blocks the decode engine lacks, decode there:
    (tokens, blocks reused on the decode side, blocks copied)."""
    prefill.add_request(prompt, GREEDY, request_id=rid)
    (first,) = prefill.prefill_step(hold=True)
    decode.add_prefilled(prompt, first.new_token_ids[0], GREEDY, rid, reuse_prefix=True)
    (seq,) = decode.admit_pulls()
    reused = seq.num_cached_tokens // decode.block_size
    src = prefill.sequence(rid).block_table.blocks
    copy_kv(prefill, src[reused:], decode, seq.block_table.blocks[reused:])
    prefill.release(rid)
    assert decode.start_decoding(rid)
    out = list(first.new_token_ids)
    while decode.has_unfinished():
        for o in decode.step():
            out += o.new_token_ids
    return out, reused, len(src) - reused


def test_decode_reuses_the_blocks_it_holds_and_pulls_only_the_rest(tiny_model):
    config = EngineConfig(num_blocks=64, block_size=8)
    prefill = LLMEngine(tiny_model, config, detokenize=False)
    decode = LLMEngine(tiny_model, config, detokenize=False)
    decode.pool.allocate(5)  # the decode side's blocks differ from prefill's
    off = LLMEngine(tiny_model, EngineConfig(num_blocks=64, prefix_cache=False))
    turn1 = BASE[:45]
    out1, reused, copied = handoff(prefill, decode, turn1, "t1")
    assert out1 == off.generate([turn1], GREEDY)[0].token_ids and (reused, copied) == (0, 6)
    # The next turn: the conversation so far (its generated blocks were cached in decode) + more.
    turn2 = turn1 + out1 + TAIL
    out2, reused, copied = handoff(prefill, decode, turn2, "t2")
    assert out2 == off.generate([turn2], GREEDY)[0].token_ids
    assert reused == (len(turn1) + len(out1) - 1) // 8 and copied == 8 - reused
    assert decode.pool.num_free == decode.pool.num_blocks - 5
    # Without reuse_prefix every block is new (the caller pulls them all).
    decode.add_prefilled(turn2, 5, GREEDY, "t3")
    (seq,) = decode.admit_pulls()
    assert seq.num_cached_tokens == 0 and decode.abort("t3")


def test_a_pulled_block_is_cached_only_once_its_kv_is_in_place(tiny_model):
    decode = LLMEngine(tiny_model, EngineConfig(num_blocks=32, block_size=8), detokenize=False)
    decode.add_prefilled(BASE[:40], 5, GREEDY, "a", reuse_prefix=True)
    decode.admit_pulls()
    assert decode.pool.num_cached == 0  # pulling: nothing written yet
    decode.add_prefilled(BASE[:40], 5, GREEDY, "b", reuse_prefix=True)
    (b,) = decode.admit_pulls()
    assert b.num_cached_tokens == 0
    assert decode.abort("a") and decode.abort("b")
    assert decode.pool.num_cached == 0 and decode.pool.num_free == decode.pool.num_blocks


# -- the emulated engine ---------------------------------------------------------------------


def test_the_emulated_engine_charges_no_prefill_time_for_a_cached_prefix(tmp_path):
    folder = create_emulated(PRESETS["opt-13b"], tmp_path / "opt-13b")
    config = EngineConfig(emulation=Emulation())
    on = LLMEngine(folder, config, detokenize=False)
    off = LLMEngine(folder, EngineConfig(emulation=Emulation(), prefix_cache=False))
    charged = []
    for e in (on, off):
        original = e.runner.times.prefill_s

        def spy(sum_l, sum_l2, original=original):
            charged.append((sum_l, sum_l2, original(sum_l, sum_l2)))
            return charged[-1][2]

        e.runner.times.prefill_s = spy
    prompt = BASE + BASE
    first = run(on, prompt)
    again = run(on, prompt)
    cold = run(off, prompt)
    assert again == (first[0], 192) and cold == (first[0], 0)
    # 8 tokens computed, attending over 200: 8^2 + 2 * 192 * 8 pairs (200^2 for a whole prompt).
    assert [c[:2] for c in charged] == [(200, 200**2), (8, 8 * (200 + 192)), (200, 200**2)]
    assert charged[1][2] < charged[0][2] == charged[2][2]
