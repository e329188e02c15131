"""n > 1 and best_of in the engine: one prefill, the choices forked over its KV (full blocks
shared, the last partial block copied per choice), each choice its own random stream; the same
tokens colocated and handed from a prefill engine to a decode engine; every block freed once."""

from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidRequest
from services.common.model_spec import PRESETS
from services.common.sampling import SamplingParams
from services.engine.config import Emulation, EngineConfig
from services.engine.engine import LLMEngine
from services.engine.presets import create_emulated
from services.engine.sequence import SequenceStatus

SEEDED = SamplingParams(max_tokens=12, temperature=1.5, seed=11, ignore_eos=True, n=3)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = list(range(2, 22))  # 20 tokens: 2 full blocks of 8 and a partial one


def real(model, **kw) -> LLMEngine:
    return LLMEngine(model, EngineConfig(num_blocks=64, block_size=8, **kw), detokenize=False)


def answers(engine: LLMEngine, params: SamplingParams, prompt=PROMPT) -> list[list[int]]:
    done = engine.generate([prompt], params)
    assert [c.index for c in done] == list(range(params.num_choices))
    return [c.token_ids for c in done]


def handoff(prefill: LLMEngine, decode: LLMEngine, params: SamplingParams, prompt=PROMPT):
    """Prefill and hold on one engine, copy its KV to another (what the pull does), decode
    there: each choice's tokens by index."""
    prefill.add_request(prompt, params, request_id="r")
    firsts = prefill.prefill_step(hold=True)
    assert sorted(o.index for o in firsts) == list(range(params.num_choices))
    assert prefill.sequence("r").status is SequenceStatus.HELD
    tokens = {o.index: list(o.new_token_ids) for o in firsts}
    going = tuple((o.index, o.new_token_ids[0]) for o in firsts if not o.finished)
    decode.add_prefilled(prompt, None, params, "r", choices=going)
    (seq,) = decode.admit_pulls()
    src = prefill.sequence("r").block_table.blocks
    for s, d in zip(src, seq.block_table.blocks, strict=True):
        decode.runner.cache.data[:, :, d] = prefill.runner.cache.data[:, :, s]
    assert prefill.release("r") == len(src)
    assert decode.start_decoding("r")
    while decode.has_unfinished():
        for o in decode.step():
            tokens[o.index] += o.new_token_ids
    return [tokens[i] for i in range(params.num_choices)]


def test_seeded_choices_differ_and_each_is_its_seed_plus_index(tiny_model):
    """Choice i samples from stream seed + i: it is the n = 1 answer of that seed."""
    got = answers(real(tiny_model), SEEDED)
    assert len({tuple(t) for t in got}) == 3
    for i, tokens in enumerate(got):
        one = SamplingParams(max_tokens=12, temperature=1.5, seed=11 + i, ignore_eos=True)
        assert tokens == answers(real(tiny_model), one)[0]


def test_greedy_choices_equal_the_single_answer(tiny_model):
    single = answers(real(tiny_model), GREEDY)[0]
    two = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2)
    assert answers(real(tiny_model), two) == [single, single]


@pytest.mark.parametrize("prompt", [PROMPT, list(range(2, 18))], ids=["partial", "full"])
def test_prefill_hold_then_pull_equals_colocated(tiny_model, prompt):
    """A prompt whose last block is partial (copied per choice) and one of whole blocks."""
    expected = answers(real(tiny_model), SEEDED, prompt)
    prefill, decode = real(tiny_model), real(tiny_model)
    assert handoff(prefill, decode, SEEDED, prompt) == expected
    assert prefill.pool.num_free == prefill.pool.num_blocks
    assert decode.pool.num_free == decode.pool.num_blocks


def test_choices_share_the_prompt_blocks_and_free_each_once(tiny_model):
    engine = real(tiny_model, prefix_cache=False)
    total = engine.pool.num_blocks
    engine.add_request(PROMPT, SEEDED, request_id="r")
    engine.step()  # the prefill: 3 choices of a 20-token prompt
    seqs = [engine.sequence("r", i) for i in range(3)]
    tables = [s.block_table.blocks for s in seqs]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]  # the full blocks, shared
    assert all(engine.pool.ref_count(b) == 3 for b in tables[0][:2])
    assert len({t[2] for t in tables}) == 3  # the partial block: one copy per choice
    assert engine.pool.num_used == 2 + 3
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free == total and engine.num_requests == 0
    # Cancelled: while waiting, right after the fork, and while decoding.
    for steps in (0, 1, 3):
        engine.add_request(PROMPT, SEEDED, request_id=f"c{steps}")
        for _ in range(steps):
            engine.step()
        assert engine.abort(f"c{steps}")
        assert engine.pool.num_free == total and engine.num_requests == 0


def test_cancelled_pull_frees_its_choices_blocks(tiny_model):
    decode = real(tiny_model, prefix_cache=False)
    decode.add_prefilled(PROMPT, None, SEEDED, "r", choices=((0, 5), (2, 7)))
    assert len(decode.admit_pulls()) == 1
    assert decode.pool.num_used == 3 + 1  # the prompt's and one copy for choice 2
    assert decode.abort("r") and decode.pool.num_free == decode.pool.num_blocks
    decode.add_prefilled(PROMPT, None, SEEDED, "s", choices=((0, 5), (2, 7)))
    decode.admit_pulls()
    assert decode.start_decoding("s")
    assert decode.sequence("s", 2).output_ids == [7]
    decode.step()
    assert decode.abort("s") and decode.pool.num_free == decode.pool.num_blocks


def test_more_choices_than_seats_is_refused(tiny_model):
    engine = real(tiny_model, max_num_seqs=4)
    with pytest.raises(InvalidRequest, match="max_num_seqs"):
        engine.add_request(PROMPT, SamplingParams(n=5))


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"best_of": 17}, "best_of"),
    ],
)
def test_choice_counts_out_of_range_are_refused(kwargs, param):
    with pytest.raises(InvalidRequest, match=r"\[") as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and "16" in str(e.value)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    model = create_emulated(PRESETS["opt-13b"], tmp_path_factory.mktemp("opt-13b-emulated"))
    tp = {
        "prefill": [1.0, 0.0001, 0.0],
        "decoding_smallbs": [0.5, 0.0, 0.0],
        "decoding_largebs": [0.5, 0.0, 0.0],
        "decoding_large_small_bs_threshold": 95,
    }
    path = tmp_path_factory.mktemp("profile") / "fast.json"
    raw = {"format": "distserve-mesh-profile/1", "model": "opt-13b", "tp": {"1": tp}}
    path.write_text(json.dumps(raw))

    def make() -> LLMEngine:
        config = EngineConfig(max_num_seqs=16, emulation=Emulation(profile=str(path)))
        return LLMEngine(model, config, detokenize=False)

    return make


def test_emulated_choices_fork_and_hand_off_alike(emulated):
    prompt = list(range(4, 40))
    expected = answers(emulated(), SEEDED, prompt)
    assert len({tuple(t) for t in expected}) == 3
    prefill, decode = emulated(), emulated()
    assert handoff(prefill, decode, SEEDED, prompt) == expected
    assert decode.pool.num_free == decode.pool.num_blocks
    with pytest.raises(InvalidRequest, match="log-probabilit"):
        emulated().add_request(prompt, SamplingParams(n=1, best_of=2))
