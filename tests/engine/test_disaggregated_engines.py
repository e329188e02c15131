"""Prefill on one engine, copy the KV blocks, decode on another: the same tokens as one engine."""

from __future__ import annotations

import pytest

from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.sequence import SequenceStatus

PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


def copy_kv(src: LLMEngine, src_blocks: list[int], dst: LLMEngine, dst_blocks: list[int]) -> None:
    """What the KV-transfer service does, as a local copy: block i of the prompt to block i."""
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        dst.runner.cache.data[:, :, d].copy_(src.runner.cache.data[:, :, s])


SEEDED = SamplingParams(max_tokens=20, temperature=1.5, seed=11, ignore_eos=True)


@pytest.mark.parametrize("params", [PARAMS, SEEDED], ids=["greedy", "seeded"])
def test_prefill_hold_pull_decode_equals_one_engine(tiny_model, params):
    """Seeded sampling too: decode's random stream moves past the draw prefill made for the
    first token, so every later token gets the draw it gets on one engine."""
    prompts = [list(range(2, 2 + n)) for n in (5, 33, 80)]
    expected = [
        r.token_ids
        for r in LLMEngine(tiny_model, EngineConfig(num_blocks=64)).generate(prompts, params)
    ]
    if params is SEEDED:  # the draws matter: not the greedy answer
        greedy = LLMEngine(tiny_model, EngineConfig(num_blocks=64)).generate(prompts, PARAMS)
        assert expected != [r.token_ids for r in greedy]
    prefill = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=8), detokenize=False)
    decode = LLMEngine(tiny_model, EngineConfig(num_blocks=64, block_size=8), detokenize=False)
    fragment = decode.pool.allocate(7)  # so the decode side's blocks differ from prefill's
    ids = [prefill.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    firsts = {o.request_id: o.new_token_ids[0] for o in prefill.prefill_step(hold=True)}
    assert all(prefill.sequence(r).status is SequenceStatus.HELD for r in ids)
    assert not prefill.has_unfinished()  # held KV is no work for the prefill instance

    for rid, prompt in zip(ids, prompts, strict=True):
        decode.add_prefilled(prompt, firsts[rid], params, rid)
    admitted = decode.admit_pulls()
    assert [s.request_id for s in admitted] == ids
    for seq in admitted:
        copy_kv(
            prefill,
            prefill.sequence(seq.request_id).block_table.blocks,
            decode,
            seq.block_table.blocks,
        )
        assert prefill.release(seq.request_id) > 0
        assert decode.start_decoding(seq.request_id)
    assert prefill.pool.num_free == prefill.pool.num_blocks

    outputs = {rid: [firsts[rid]] for rid in ids}
    while decode.has_unfinished():
        for o in decode.step():
            outputs[o.request_id] += o.new_token_ids
    assert [outputs[r] for r in ids] == expected
    decode.pool.free(fragment)
    assert decode.pool.num_free == decode.pool.num_blocks


def test_pulls_wait_for_room_in_order(tiny_model):
    decode = LLMEngine(tiny_model, EngineConfig(num_blocks=10, block_size=8), detokenize=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    decode.add_prefilled([3] * 60, 5, params, "big")  # 8 blocks
    decode.add_prefilled([3] * 30, 5, params, "next")  # 4 blocks: must wait for "big"
    assert [s.request_id for s in decode.admit_pulls()] == ["big"]
    assert decode.admit_pulls() == []
    assert decode.abort("big")
    assert [s.request_id for s in decode.admit_pulls()] == ["next"]
    assert decode.abort("next") and decode.pool.num_free == 10


def test_release_and_abort_of_held_kv(tiny_model):
    prefill = LLMEngine(tiny_model, EngineConfig(num_blocks=32), detokenize=False)
    prefill.add_request([4] * 40, PARAMS, request_id="a")
    prefill.add_request([4] * 40, PARAMS, request_id="b")
    prefill.prefill_step(hold=True)
    assert prefill.pool.num_used == 6
    assert prefill.release("a") == 3 and prefill.release("a") == 0
    assert prefill.abort("b")
    assert prefill.pool.num_free == 32


def test_pulls_are_admitted_only_while_the_decode_batch_has_seats(tiny_model):
    decode = LLMEngine(
        tiny_model, EngineConfig(num_blocks=64, block_size=8, max_num_seqs=2), detokenize=False
    )
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(3):
        decode.add_prefilled([3] * 10, 5, params, f"r{i}")
    assert [s.request_id for s in decode.admit_pulls()] == ["r0", "r1"]
    decode.start_decoding("r0")
    assert decode.admit_pulls() == []  # r0 runs and r1 is pulling: both seats are taken
    assert decode.abort("r1")
    assert [s.request_id for s in decode.admit_pulls()] == ["r2"]
