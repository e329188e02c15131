"""Structured output in the engine: every answer parses and validates against its schema (or
matches its regex or choice), greedy and seeded; greedy answers equal transformers' greedy
decoding masked by llguidance directly (same weights, same grammar text); a matcher rebuilt from
the spec and replayed over an answer's first tokens goes on exactly as the original; constrained
rows leave the batch's other rows alone; specs that cannot compile or match are refused by
name; the emulated engine draws only tokens the grammar allows."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from services.common.errors import InvalidRequest
from services.common.model_spec import PRESETS
from services.common.sampling import FinishReason, SamplingParams
from services.common.structured_output import GuideKind, StructuredOutput
from services.engine.config import Emulation, EngineConfig
from services.engine.engine import LLMEngine
from services.engine.presets import create_emulated

PROMPTS = ["The answer is", "Prefill computes the KV of", "JSON:"]
# Bounded schemas: every answer ends within the token budget (with compact whitespace).
SCHEMAS = {
    "object-with-required": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "admin": {"type": "boolean"},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum": {"enum": ["red", "green", "blue"]},
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 1,
        "maxItems": 4,
    },
    "nested": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
                "required": ["b"],
                "additionalProperties": False,
            }
        },
        "required": ["a"],
        "additionalProperties": False,
    },
}
MAX_TOKENS = 64


def json_spec(schema: dict, any_whitespace: bool = False) -> StructuredOutput:
    return StructuredOutput(GuideKind.JSON, json.dumps(schema), any_whitespace=any_whitespace)


@pytest.fixture(scope="module")
def engine(tiny_model) -> LLMEngine:
    return LLMEngine(tiny_model, EngineConfig(num_blocks=256))


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=7)])
@pytest.mark.parametrize("name", SCHEMAS)
def test_every_answer_parses_and_validates_against_its_schema(engine, name, sampling):
    schema = SCHEMAS[name]
    params = SamplingParams(max_tokens=MAX_TOKENS, structured_output=json_spec(schema), **sampling)
    for c in engine.generate(PROMPTS, params):
        assert c.finish_reason is FinishReason.STOP, (name, c.text)
        jsonschema.validate(json.loads(c.text), schema)
        # Complete means stopped at once: no EOS sampled after the closing token.
        assert engine.tokenizer.decode(c.token_ids) == c.text


def test_flexible_whitespace_answers_are_json_objects(engine):
    params = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        structured_output=json_spec(SCHEMAS["enum"] | {"type": "string"}, any_whitespace=True),
    )
    spec = StructuredOutput(GuideKind.JSON_OBJECT)
    obj = SamplingParams(max_tokens=8, temperature=0.0, structured_output=spec)
    for c in engine.generate(PROMPTS, params):
        assert (
            c.finish_reason is FinishReason.STOP and json.loads(c.text) in SCHEMAS["enum"]["enum"]
        )
    for c in engine.generate(PROMPTS, obj):  # cut short: a prefix of an object
        assert c.finish_reason is FinishReason.LENGTH and c.text.startswith("{")


def test_regex_choice_and_grammar_answers_match(engine):
    cases = [
        (StructuredOutput(GuideKind.REGEX, r"[a-z]{2,6}-[0-9]{1,3}"), r"[a-z]{2,6}-[0-9]{1,3}"),
        (StructuredOutput(GuideKind.CHOICE, ("yes", "no", "maybe")), r"yes|no|maybe"),
        (StructuredOutput(GuideKind.GRAMMAR, 'root ::= "x" [0-9] [0-9]? "y"'), r"x[0-9]{1,2}y"),
        (StructuredOutput(GuideKind.GRAMMAR, 'start: "<" /[ab]{3}/ ">"'), r"<[ab]{3}>"),
    ]
    for spec, pattern in cases:
        for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=3)):
            params = SamplingParams(max_tokens=MAX_TOKENS, structured_output=spec, **sampling)
            for c in engine.generate(PROMPTS, params):
                assert c.finish_reason is FinishReason.STOP, (spec, c.text)
                assert re.fullmatch(pattern, c.text), (spec, c.text)


def reference(model_dir, prompt: list[int], spec: StructuredOutput, max_tokens: int) -> list[int]:
    """transformers' greedy decoding with each step's logits masked by an llguidance matcher
    of the same grammar text, stopping when the matcher is (the engine's rule)."""
    import llguidance
    from transformers import AutoModelForCausalLM

    from services.common.model_config import ModelConfig

    mc = ModelConfig.from_dir(model_dir)
    tok = llguidance.LLTokenizer(
        (model_dir / "tokenizer.json").read_text(),
        n_vocab=mc.vocab_size,
        eos_token=list(mc.eos_token_ids),
    )
    matcher = llguidance.LLMatcher(tok, spec.grammar())
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        while len(out) < max_tokens and not matcher.is_stopped():
            logits = hf(torch.tensor([ids])).logits[0, -1]
            bits = np.unpackbits(
                np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little"
            )
            allowed = torch.from_numpy(bits[: logits.shape[0]].astype(bool))
            token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
            assert matcher.consume_token(token)
            ids.append(token)
            out.append(token)
    return out


@pytest.mark.parametrize(
    "spec",
    [
        json_spec(SCHEMAS["object-with-required"], any_whitespace=True),
        json_spec(SCHEMAS["nested"]),
        StructuredOutput(GuideKind.REGEX, r"(\[[a-z]+\] )+"),
    ],
    ids=["object-flexible-whitespace", "nested", "regex"],
)
def test_greedy_answers_equal_transformers_masked_by_llguidance(engine, tiny_model, spec):
    prompt = engine.tokenizer.encode(PROMPTS[0])
    [c] = engine.generate(
        [prompt], SamplingParams(max_tokens=40, temperature=0.0, structured_output=spec)
    )
    assert c.token_ids == reference(tiny_model, prompt, spec, 40)


def test_a_matcher_replayed_over_the_first_tokens_goes_on_as_the_original(engine):
    """What decode does with prefill's first token, and a migration with the tokens sent."""
    spec = StructuredOutput(GuideKind.REGEX, r"(\[[a-z]+\] )+")
    prompt = engine.tokenizer.encode("The decode phase adds one token at a time")
    [whole] = engine.generate(
        [prompt], SamplingParams(max_tokens=60, temperature=0.0, structured_output=spec)
    )
    for k in (1, 8, 30):
        rest = SamplingParams(
            max_tokens=60 - k, temperature=0.0, structured_output=spec.replayed(k)
        )
        [moved] = engine.generate([prompt + whole.token_ids[:k]], rest)
        assert moved.token_ids == whole.token_ids[k:]
    # Without the replay the grammar starts over, and the answer is another one.
    fresh = SamplingParams(max_tokens=52, temperature=0.0, structured_output=spec)
    assert (
        engine.generate([prompt + whole.token_ids[:8]], fresh)[0].token_ids != whole.token_ids[8:]
    )


def test_constrained_rows_leave_the_other_rows_of_the_batch_alone(engine):
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = engine.generate(PROMPTS, free)
    spec = json_spec(SCHEMAS["array"])
    mixed = engine.generate(
        PROMPTS * 2,
        [free] * 3 + [SamplingParams(max_tokens=24, temperature=0.0, structured_output=spec)] * 3,
    )
    assert [c.token_ids for c in mixed[:3]] == [c.token_ids for c in alone]
    for c in mixed[3:]:
        jsonschema.validate(json.loads(c.text), SCHEMAS["array"])


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        (GuideKind.JSON, '{"type": "frobnicate"}', "cannot be compiled"),
        (GuideKind.JSON, '{"type": "integer", "minimum": 5, "maximum": 2}', "Unsatisfiable"),
        (GuideKind.JSON, "{not json", "not valid JSON"),
        (GuideKind.REGEX, "(?!a)b", "look-around"),
        (GuideKind.GRAMMAR, "start: 'a' |", "cannot"),
        (GuideKind.CHOICE, (), "non-empty list"),
    ],
)
def test_a_spec_that_cannot_compile_is_refused_naming_the_field(kind, spec, message):
    with pytest.raises(InvalidRequest, match=message) as err:
        StructuredOutput(kind, spec)
    assert err.value.param == "structured_output"


def test_a_regex_that_no_answer_matches_is_refused_and_holds_nothing(engine):
    spec = StructuredOutput(GuideKind.REGEX, r"[^\s\S]")  # compiles; its language is empty
    free = engine.pool.num_free
    with pytest.raises(InvalidRequest, match="matches no answer") as err:
        engine.add_request("x", SamplingParams(max_tokens=4, structured_output=spec))
    assert err.value.param == "structured_output"
    assert engine.num_requests == 0 and engine.pool.num_free == free
    bad_replay = StructuredOutput(GuideKind.CHOICE, ("yes", "no"), replay_tokens=2)
    with pytest.raises(InvalidRequest, match="do not match"):
        engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=4, structured_output=bad_replay))


def test_the_emulated_engine_draws_only_tokens_the_grammar_allows(tmp_path):
    model = create_emulated(PRESETS["opt-13b"], tmp_path / "opt-13b")
    fast = {
        "prefill": [1.0, 0.0001, 0.0],
        "decoding_smallbs": [0.5, 0.0, 0.0],
        "decoding_largebs": [0.5, 0.0, 0.0],
        "decoding_large_small_bs_threshold": 95,
    }
    profile = tmp_path / "fast.json"
    profile.write_text(
        json.dumps({"format": "distserve-mesh-profile/1", "model": "opt-13b", "tp": {"1": fast}})
    )
    em = LLMEngine(model, EngineConfig(emulation=Emulation(profile=str(profile))))
    for name in ("enum", "array", "object-with-required"):
        params = SamplingParams(max_tokens=MAX_TOKENS, structured_output=json_spec(SCHEMAS[name]))
        for c in em.generate([[5, 6, 7], [8, 9, 10, 11]], params):
            assert c.finish_reason is FinishReason.STOP, (name, c.text)
            jsonschema.validate(json.loads(c.text), SCHEMAS[name])
