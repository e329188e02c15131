"""How generation ends: max_tokens, EOS, stop token ids, stop strings."""

from __future__ import annotations

import dataclasses

from services.common.sampling import FinishReason, SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine

PROMPT = "The prefill phase"


def run(
    engine: LLMEngine, params: SamplingParams
) -> tuple[list[int], str, list[str], FinishReason]:
    rid = engine.add_request(PROMPT, params)
    ids, deltas, reason = [], [], None
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id == rid
            ids += o.new_token_ids
            deltas.append(o.text_delta)
            reason = o.finish_reason
    return ids, "".join(deltas), deltas, reason


def test_max_tokens_and_ignore_eos(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64))
    ids, text, _, reason = run(engine, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    assert len(ids) == 7 and reason is FinishReason.LENGTH
    assert text == engine.tokenizer.decode(ids)


def test_stop_token_ids_and_eos_end_generation(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64))
    full, *_ = run(engine, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    stop_at = full[10]
    first = full.index(stop_at)
    ids, _, _, reason = run(
        engine, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_at])
    )
    assert ids == full[: first + 1] and reason is FinishReason.STOP
    # The same token as the model's EOS (via a config that names it) ends generation unless
    # ignore_eos is set.
    engine.model_config = engine.model_config.__class__(
        **{**engine.model_config.__dict__, "eos_token_ids": (stop_at,)}
    )
    ids, _, _, reason = run(engine, SamplingParams(max_tokens=30, temperature=0))
    assert ids == full[: first + 1] and reason is FinishReason.STOP


def test_stop_string_split_across_tokens_is_never_streamed(tiny_model):
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64))
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ids, full_text, _, _ = run(engine, greedy)
    # A stop string that starts inside one token and ends inside a later one.
    # (The first one from token 12 on whose text does not occur earlier in the output.)
    pieces = [engine.tokenizer.decode(ids[:k]) for k in range(len(ids))]
    starts = (len(pieces[k]) - 1 for k in range(12, len(ids) - 4))
    start = next(a for a in starts if full_text.index(full_text[a : a + 6]) == a)
    stop = full_text[start : start + 6]
    assert len(stop) == 6
    _, text, deltas, reason = run(
        engine,
        SamplingParams(
            max_tokens=40, temperature=0, ignore_eos=True, stop=["zzzz-not-there", stop]
        ),
    )
    assert reason is FinishReason.STOP
    assert text == full_text[:start]
    assert stop not in text and all(stop not in d for d in deltas)


def test_min_tokens_holds_back_stop_token_ids_and_stop_strings(tiny_model):
    """As in vLLM: before min_tokens tokens, a stop token id cannot be sampled and a stop string
    does not stop; after them both end generation as usual."""
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=64))
    full, full_text, _, _ = run(
        engine, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    )
    stop_id = full[3]
    ids, _, _, reason = run(
        engine,
        SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_id], min_tokens=8),
    )
    assert stop_id not in ids[:8]  # masked: the model said something else there
    if reason is FinishReason.STOP:  # the first time after min_tokens ends it
        assert len(ids) > 8 and ids[-1] == stop_id and stop_id not in ids[:-1]
    else:  # or the rest of the answer never came back to it
        assert reason is FinishReason.LENGTH and stop_id not in ids
    # A stop string in the text of the first tokens (two, or as few after them as hold three
    # characters): it stops a plain request there, but with min_tokens 6 only an occurrence
    # starting after the sixth token's text stops.
    k = next(k for k in range(2, 6) if len(engine.tokenizer.decode(full[:k])) >= 3)
    head = len(engine.tokenizer.decode(full[:k]))
    early = full_text[head - 3 : head]
    stop = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=[early])
    _, text, _, reason = run(engine, stop)
    assert reason is FinishReason.STOP and len(text) < head
    _, text, _, reason = run(engine, dataclasses.replace(stop, min_tokens=6))
    later = full_text.find(early, len(engine.tokenizer.decode(full[:6])))
    assert text == (full_text if later < 0 else full_text[:later])
    assert reason is (FinishReason.LENGTH if later < 0 else FinishReason.STOP)
