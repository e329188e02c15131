"""The emulated engine: the real engine with the forward pass replaced by its modelled time.

Tokens are a function of the KV payload (deterministic, equal on every path, changed by wrong
KV); steps last the profile's time times the clock's scale; memory is the planner's sizing;
the real and the emulated engine never serve each other's models.
"""

from __future__ import annotations

import json
import time

import pytest

from services.common import clock
from services.common.errors import InvalidRequest, UnsupportedModel
from services.common.latency import for_model
from services.common.model_spec import GIB, PRESETS, kv_capacity
from services.common.sampling import FinishReason, SamplingParams
from services.engine.config import Emulation, EngineConfig
from services.engine.engine import LLMEngine
from services.engine.presets import create_emulated
from services.engine.sequence import SequenceStatus

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [[7] * 5, list(range(4, 90)), [3, 1, 4, 1, 5, 9, 2, 6] * 30]


@pytest.fixture(scope="module")
def opt13b(tmp_path_factory):
    """The emulated folder of OPT-13B (a shape and a tokenizer, no weights)."""
    return create_emulated(PRESETS["opt-13b"], tmp_path_factory.mktemp("opt-13b-emulated"))


@pytest.fixture(scope="module")
def fast_profile(tmp_path_factory):
    """A profile of a very fast device (steps of ~1 ms), for tests about tokens, not time."""
    tp = {
        "prefill": [1.0, 0.0001, 0.0],
        "decoding_smallbs": [0.5, 0.0, 0.0],
        "decoding_largebs": [0.5, 0.0, 0.0],
        "decoding_large_small_bs_threshold": 95,
    }
    path = tmp_path_factory.mktemp("profile") / "fast.json"
    raw = {"format": "distserve-mesh-profile/1", "model": "opt-13b", "tp": {"1": tp, "2": tp}}
    path.write_text(json.dumps(raw))
    return str(path)


def engine(model, profile=None, max_batch_tokens=0, **emulation) -> LLMEngine:
    config = EngineConfig(
        max_num_seqs=64,
        max_batch_tokens=max_batch_tokens,
        emulation=Emulation(profile=profile, **emulation),
    )
    return LLMEngine(model, config, detokenize=False)


def test_emulated_tokens_are_deterministic_across_engines(opt13b, fast_profile):
    first = [c.token_ids for c in engine(opt13b, fast_profile).generate(PROMPTS, GREEDY)]
    again = [c.token_ids for c in engine(opt13b, fast_profile).generate(PROMPTS, GREEDY)]
    assert first == again
    assert all(len(ids) == GREEDY.max_tokens for ids in first)
    assert len({tuple(ids) for ids in first}) == len(PROMPTS)  # prompts give other tokens
    alone = engine(opt13b, fast_profile).generate([PROMPTS[1]], GREEDY)[0].token_ids
    assert alone == first[1]  # whatever else shares the batch


def _handoff(prefill: LLMEngine, decode: LLMEngine, prompts, corrupt: bool = False):
    """Prefill and hold on one engine, copy the KV payload to another, decode there."""
    ids = [prefill.add_request(p, GREEDY, request_id=f"r{i}") for i, p in enumerate(prompts)]
    firsts = {o.request_id: o.new_token_ids[0] for o in prefill.prefill_step(hold=True)}
    for rid, p in zip(ids, prompts, strict=True):
        decode.add_prefilled(p, firsts[rid], GREEDY, rid)
    for seq in decode.admit_pulls():
        src = prefill.sequence(seq.request_id).block_table.blocks
        for s, d in zip(src, seq.block_table.blocks, strict=True):
            decode.runner.cache.data[:, :, d] = prefill.runner.cache.data[:, :, s]
        if corrupt:
            decode.runner.cache.data[1, 1, seq.block_table.blocks[0], 3] += 1.0
        prefill.release(seq.request_id)
        decode.start_decoding(seq.request_id)
    out = {rid: [firsts[rid]] for rid in ids}
    while decode.has_unfinished():
        for o in decode.step():
            out[o.request_id] += o.new_token_ids
    return [out[r] for r in ids]


def test_emulated_kv_handoff_gives_the_colocated_tokens_and_wrong_kv_other_ones(
    opt13b, fast_profile
):
    colocated = [c.token_ids for c in engine(opt13b, fast_profile).generate(PROMPTS, GREEDY)]
    prefill, decode = engine(opt13b, fast_profile), engine(opt13b, fast_profile)
    decode.pool.allocate(5)  # the decode side's blocks differ from prefill's
    assert _handoff(prefill, decode, PROMPTS) == colocated
    assert prefill.pool.num_free == prefill.pool.num_blocks
    prefill, decode = engine(opt13b, fast_profile), engine(opt13b, fast_profile)
    corrupted = _handoff(prefill, decode, PROMPTS, corrupt=True)
    # the first token came from prefill; every later one reads the wrong KV
    assert all(c[0] == g[0] and c[1:] != g[1:] for c, g in zip(corrupted, colocated, strict=True))


def test_a_request_continued_elsewhere_gives_the_same_tokens(opt13b, fast_profile):
    """Migration re-prefills prompt + tokens so far: the rest must be what it would have been."""
    whole = engine(opt13b, fast_profile).generate([PROMPTS[2]], GREEDY)[0].token_ids
    rest = SamplingParams(max_tokens=GREEDY.max_tokens - 10, temperature=0.0, ignore_eos=True)
    continued = engine(opt13b, fast_profile).generate([PROMPTS[2] + whole[:10]], rest)[0]
    assert continued.token_ids == whole[10:]


def test_eos_ends_a_request_unless_ignored_and_max_tokens_bounds_it(opt13b, fast_profile):
    e = engine(opt13b, fast_profile)
    prompts = [[i % 900 + 4, 5, 6] for i in range(60)]
    stopping = e.generate(prompts, SamplingParams(max_tokens=120, temperature=0.0))
    eos = e.model_config.eos_token_ids
    stopped = [c for c in stopping if c.finish_reason is FinishReason.STOP]
    assert stopped, "one EOS in ~900 tokens: some of 7,200 tokens must be EOS"
    assert all(c.token_ids[-1] in eos and len(c.token_ids) <= 120 for c in stopped)
    ignoring = e.generate(prompts, SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
    assert all(len(c.token_ids) == 120 and c.finish_reason is FinishReason.LENGTH for c in ignoring)


def test_sampled_requests_follow_their_seed(opt13b, fast_profile):
    p = SamplingParams(max_tokens=16, temperature=0.8, seed=11, ignore_eos=True)
    a = engine(opt13b, fast_profile).generate([PROMPTS[0]], p)[0].token_ids
    b = engine(opt13b, fast_profile).generate([PROMPTS[0]], p)[0].token_ids
    greedy = engine(opt13b, fast_profile).generate([PROMPTS[0]], GREEDY)[0].token_ids[:16]
    assert a == b and a != greedy


def test_kv_pool_is_the_planners_capacity_on_the_emulated_devices(opt13b, fast_profile):
    spec = PRESETS["opt-13b"]
    one = engine(opt13b, fast_profile)
    assert one.pool.num_blocks == kv_capacity(spec, 1, 1) // 16
    two = engine(opt13b, fast_profile, tp=2)
    assert two.pool.num_blocks == kv_capacity(spec, 2, 1) // 16 > 2 * one.pool.num_blocks
    small = engine(opt13b, fast_profile, gpu_memory_gib=40)
    assert small.pool.num_blocks == kv_capacity(spec, 1, 1, 40 * GIB) // 16
    assert small.pool.num_blocks < one.pool.num_blocks
    with pytest.raises(UnsupportedModel, match="no room for KV"):
        engine(opt13b, fast_profile, gpu_memory_gib=20)  # 26 GB of weights


def test_a_long_request_waits_for_room_as_on_the_device(opt13b, fast_profile):
    """Memory pressure as on the device: past its capacity, prompts wait to be admitted."""
    e = engine(opt13b, fast_profile, gpu_memory_gib=30)  # room for a few thousand tokens
    per = 1500
    n = e.pool.num_blocks * 16 // (per + 24) + 2
    for i in range(n):
        e.add_request([i % 900 + 4] * per, GREEDY)
    e.step()
    assert e.running.seqs and len(e.waiting) >= 1  # those that did not fit wait
    while e.has_unfinished():
        e.step()
    assert e.pool.num_free == e.pool.num_blocks


def test_a_step_lasts_its_modelled_time_times_the_scale(opt13b):
    """The A100 profile of OPT-13B at time scale 3: a prefill batch lasts its modelled time
    times 3, and decode steps keep the modelled cadence times 3 (the engine's own work between
    steps overlaps the modelled time; a step that woke late is followed by a shorter one), within
    10%."""
    e = engine(opt13b, max_batch_tokens=2048)
    times = e.runner.times
    clock.setup(3.0)
    try:
        for i in range(4):
            e.add_request([i + 4] * 512, SamplingParams(max_tokens=6, ignore_eos=True))
        t = time.monotonic()
        e.step()
        prefill_wall = time.monotonic() - t
        assert e.last_step == ("prefill", 4, 2048)  # all 4 prompts in one batch of L_m tokens
        modelled = times.prefill_s(4 * 512, 4 * 512 * 512)
        assert prefill_wall == pytest.approx(3 * modelled, rel=0.1)
        expected = 0.0
        t = time.monotonic()
        while e.has_unfinished():
            expected += 3 * times.decode_s(4, sum(s.num_tokens for s in e.running.seqs))
            e.step()
        assert time.monotonic() - t == pytest.approx(expected, rel=0.1)
        assert e.last_step == ("decode", 4, 4)
    finally:
        clock.setup(1.0)


def test_l_m_is_by_default_the_profiles_saturation_point_at_the_workers_tp(opt13b, tiny_model):
    """As the planner's simulator sets each instance's L_m: an instance re-sharded to another
    tensor degree batches prompts as that degree should."""
    lat = for_model(PRESETS["opt-13b"], None)
    sizes = {tp: engine(opt13b, tp=tp).max_batch_tokens for tp in (1, 2, 4)}
    assert sizes == {tp: lat.saturation_tokens(tp) for tp in (1, 2, 4)}
    assert len(set(sizes.values())) > 1  # the degrees differ, or this proves nothing
    assert engine(opt13b, max_batch_tokens=700).max_batch_tokens == 700  # given: kept
    real = LLMEngine(tiny_model, EngineConfig(num_blocks=8), detokenize=False)
    assert real.max_batch_tokens == 2048


def test_step_times_are_the_planners_latency_model(opt13b):
    e = engine(opt13b, tp=2)
    lat = for_model(PRESETS["opt-13b"], None).at(2)
    assert e.runner.times.decode_s(10, 5000) == pytest.approx(lat.decode_ms(10, 5000) / 1000)
    colocated = engine(opt13b, profile_fit="vllm")
    vllm = for_model(PRESETS["opt-13b"], None, "vllm").at(1)
    assert colocated.runner.times.decode_s(3, 900) == pytest.approx(vllm.decode_ms(3, 900) / 1000)


def test_the_real_engine_refuses_an_emulated_folder_and_back(opt13b, tiny_model):
    with pytest.raises(UnsupportedModel, match="--engine emulated"):
        LLMEngine(opt13b, EngineConfig(num_blocks=8))
    with pytest.raises(UnsupportedModel, match="emulated model's folder"):
        engine(tiny_model)
    assert not list(opt13b.glob("*.safetensors"))  # no weights to load


def test_held_kv_is_released_as_for_a_real_model(opt13b, fast_profile):
    e = engine(opt13b, fast_profile)
    rid = e.add_request(PROMPTS[1], GREEDY)
    e.prefill_step(hold=True)
    assert e.sequence(rid).status is SequenceStatus.HELD
    assert e.release(rid) == -(-len(PROMPTS[1]) // 16)
    assert e.pool.num_free == e.pool.num_blocks


def test_min_tokens_holds_eos_back_and_other_processors_are_validated(opt13b, fast_profile):
    """No logits here: min_tokens is honoured by drawing a too-early stop id again; the
    penalties, min_p and logit_bias are validated as on the real engine (ids against this
    vocabulary) and leave the tokens as they are."""
    e = engine(opt13b, fast_profile)
    prompts = [[i % 900 + 4, 5, 6] for i in range(60)]
    plain = e.generate(prompts, SamplingParams(max_tokens=120, temperature=0.0))
    early = [c for c in plain if c.finish_reason is FinishReason.STOP]
    assert early, "one EOS in ~900 tokens: some of 7,200 tokens must be EOS"
    held = e.generate(prompts, SamplingParams(max_tokens=120, temperature=0.0, min_tokens=120))
    assert all(len(c.token_ids) == 120 and c.finish_reason is FinishReason.LENGTH for c in held)
    processed = SamplingParams(
        max_tokens=24,
        temperature=0.0,
        ignore_eos=True,
        presence_penalty=1.0,
        repetition_penalty=1.5,
        min_p=0.5,
        logit_bias={5: -100.0},
    )
    got = [c.token_ids for c in e.generate(PROMPTS, processed)]
    assert got == [c.token_ids for c in e.generate(PROMPTS, GREEDY)]
    vocab = e.model_config.vocab_size
    bad = SamplingParams(max_tokens=4, logit_bias={vocab: 1.0})
    with pytest.raises(InvalidRequest, match=f"logit_bias names token id {vocab}"):
        e.add_request(PROMPTS[0], bad)
