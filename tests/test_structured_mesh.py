"""Structured output through the mesh: prefill samples the first token under the grammar's mask
and decode rebuilds the matcher from the spec and reads that token, so the answer equals the
colocated engine's, token for token, and validates against its schema (or matches its regex or
choice). A request moved to another decode instance mid-answer replays the tokens sent into its
new matcher. Bad specs are clear 400s on both APIs; nothing is left held afterwards."""

from __future__ import annotations

import asyncio
import json
import re
import signal

import grpc
import jsonschema
import pytest
import requests

from services.common.convert import sampling_from_pb
from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from tests.conftest import start_mesh, stop_now
from tests.test_mesh import kv_all_free, stats, wait_until
from tests.test_resilience import _process, _serving_decode, migrations

PROMPTS = ["The answer is", "Prefill computes the KV of", "JSON:"]
OBJECT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
ENUM = {"enum": ["red", "green", "blue"]}
ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4}
NESTED = {
    "type": "object",
    "properties": {
        "a": {
            "type": "object",
            "properties": {"b": ARRAY},
            "required": ["b"],
            "additionalProperties": False,
        }
    },
    "required": ["a"],
    "additionalProperties": False,
}
CASES = {
    "object": (common_pb2.StructuredOutput(json_schema=json.dumps(OBJECT)), OBJECT),
    "enum": (common_pb2.StructuredOutput(json_schema=json.dumps(ENUM)), ENUM),
    "array": (
        common_pb2.StructuredOutput(json_schema=json.dumps(ARRAY), disable_any_whitespace=True),
        ARRAY,
    ),
    "nested": (
        common_pb2.StructuredOutput(json_schema=json.dumps(NESTED), disable_any_whitespace=True),
        NESTED,
    ),
    "regex": (
        common_pb2.StructuredOutput(regex=r"[a-z]{2,6}-[0-9]{1,3}"),
        r"[a-z]{2,6}-[0-9]{1,3}",
    ),
    "choice": (
        common_pb2.StructuredOutput(choice=common_pb2.Choices(choices=["yes", "no", "maybe"])),
        r"yes|no|maybe",
    ),
}
MAX_TOKENS = 96


def sampling(case: str, **fields) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(
        max_tokens=MAX_TOKENS, structured_output=CASES[case][0], **fields
    )


def check(case: str, text: str) -> None:
    want = CASES[case][1]
    if isinstance(want, dict):
        jsonschema.validate(json.loads(text), want)
    else:
        assert re.fullmatch(want, text), (case, text)


async def generate(address: str, prompt: str, params: common_pb2.SamplingParams):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        ids, text, last = [], [], None
        req = gateway_pb2.GenerateRequest(text=prompt, sampling=params)
        async for r in stub.Generate(req, timeout=60):
            ids += r.token_ids
            text.append(r.text)
            last = r
        return ids, "".join(text), last


@pytest.fixture(scope="module")
def colocated_answers(tiny_model):
    """Each case's greedy answers from one in-process engine."""
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=256))
    return {
        case: [
            c.token_ids
            for c in engine.generate(PROMPTS, sampling_from_pb(sampling(case, temperature=0.0)))
        ]
        for case in CASES
    }


@pytest.mark.parametrize("shape", ["1P1D", "colocated"])
def test_answers_through_the_mesh_equal_the_engine_and_validate(
    shared_mesh, mesh_factory, colocated_answers, shape
):
    mesh = shared_mesh if shape == "1P1D" else mesh_factory(prefill=0, decode=0, colocated=1)

    async def run_all():
        calls = [
            generate(mesh.gateway_address, prompt, sampling(case, **fields))
            for fields in (dict(temperature=0.0), dict(temperature=1.0, seed=11))
            for case in CASES
            for prompt in PROMPTS
        ]
        return await asyncio.gather(*calls)

    results = iter(asyncio.run(run_all()))
    for greedy in (True, False):
        for case in CASES:
            for i, _ in enumerate(PROMPTS):
                ids, text, last = next(results)
                assert last.finish_reason == common_pb2.FINISH_REASON_STOP, (case, text)
                check(case, text)
                if greedy:
                    assert ids == colocated_answers[case][i], f"{case}: prompt {i} diverged"
    wait_until(lambda: kv_all_free(mesh), what="KV blocks to be freed everywhere")


def http_error(mesh, body: dict) -> tuple[int, dict]:
    url = f"http://{mesh.gateway_http_address}/v1/completions"
    r = requests.post(url, json={"prompt": "x", "max_tokens": 8, **body}, timeout=30)
    return r.status_code, r.json().get("error", {})


def grpc_error(mesh, structured: common_pb2.StructuredOutput) -> grpc.RpcError:
    params = common_pb2.SamplingParams(max_tokens=8, structured_output=structured)
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(gateway_pb2.GenerateRequest(text="x", sampling=params), timeout=30))
    return err.value


BAD_HTTP = [
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}},
        "response_format",
        "cannot be compiled: Invalid type: foo",
    ),
    ({"guided_json": {"minimum": 3, "maximum": 1, "type": "integer"}}, "guided_json", "Unsatis"),
    ({"guided_regex": "(?!x)y"}, "guided_regex", "look-around"),
    ({"guided_grammar": "root ::= foo"}, "guided_grammar", "Rule 'foo' not found"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"response_format": {"type": "yaml"}}, "response_format", "must be one of text"),
    (
        {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
        "guided_regex",
        "'response_format' and 'guided_regex' both constrain the answer",
    ),
    (
        {"structured_outputs": {"regex": "a+", "choice": ["a"]}},
        "structured_outputs",
        "'structured_outputs.regex' and 'structured_outputs.choice' both constrain",
    ),
    (
        {"structured_outputs": {"regex": "a+", "whitespace_pattern": " "}},
        "structured_outputs",
        "whitespace_pattern' is not supported",
    ),
]


def test_bad_specs_are_clear_400s_and_nothing_is_held(shared_mesh):
    mesh = shared_mesh
    for body, param, message in BAD_HTTP:
        status, error = http_error(mesh, body)
        assert status == 400 and error["param"] == param, (body, error)
        assert message in error["message"], (body, error)
    err = grpc_error(mesh, common_pb2.StructuredOutput(json_schema='{"type": "foo"}'))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Invalid type: foo" in err.details()
    assert grpc_error(mesh, common_pb2.StructuredOutput()).code() == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    # A regex that compiles but that no text matches: found by the prefill instance, with the
    # tokenizer; a 400 all the same, and the prompt it refused holds no KV.
    never = common_pb2.StructuredOutput(regex=r"[^\s\S]")
    err = grpc_error(mesh, never)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "matches no answer" in err.details()
    status, error = http_error(mesh, {"guided_regex": r"[^\s\S]"})
    assert status == 400 and "the regex constraint matches no answer" in error["message"]
    wait_until(lambda: kv_all_free(mesh), what="KV blocks to be freed everywhere")


def test_a_request_moved_mid_answer_keeps_its_grammar_state(tiny_model):
    """The serving decode instance is killed after 8 tokens: the gateway moves the rest of the
    request (prompt + tokens sent) to the other one, whose matcher replays the tokens sent.
    Without the replay the grammar would start over and the answer would differ."""
    prompt = "The decode phase adds one token at a time"
    spec = common_pb2.StructuredOutput(regex=r"(\[[a-z]+\] )+")
    params = common_pb2.SamplingParams(max_tokens=400, structured_output=spec)
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=256))
    [want] = engine.generate([prompt], sampling_from_pb(params))
    mesh = start_mesh(tiny_model, prefill=1, decode=2)
    try:
        before = migrations(mesh)
        ids, killed = [], []
        with grpc.insecure_channel(mesh.gateway_address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            req = gateway_pb2.GenerateRequest(text=prompt, sampling=params)
            for r in stub.Generate(req, timeout=120):
                ids += r.token_ids
                if not killed and len(ids) >= 8:
                    killed.append(_serving_decode(mesh))
                    _process(mesh, killed[0]).popen.send_signal(signal.SIGKILL)
        assert killed and ids == want.token_ids
        assert migrations(mesh) == before + 1
        prefill = [p.ready["address"] for p in mesh.workers if p.name.startswith("prefill")]
        wait_until(lambda: stats(prefill[0], "prefill").load.held_kv_handles == 0)
    finally:
        stop_now(mesh)
