"""Fuzzing the OpenAI-compatible HTTP API, on the gateway's own port and through Envoy.

Two generators, both deterministic (a fixed seed, derandomized, no example database):
- schemathesis, from the OpenAPI document the server serves: every operation with data that fits
  the document, and with data that breaks it (request bodies). Checks: no 5xx, the status codes,
  content types, headers and bodies the document declares, schema-invalid data rejected, every
  answer within RESPONSE_TIME_S.
- hypothesis, valid requests with hostile values mixed in and raw bodies the document cannot
  describe: lone surrogates, NaN and infinities, integers past every width, deep nesting, bytes
  that are not JSON, odd request ids, clients that leave mid-stream. Checks: no 5xx, errors in
  OpenAI's shape, streams that end with `data: [DONE]` and no server error event.
Then each documented limit (prompt, max_tokens, stop strings, stop token ids, body size) at and
past its edge, and a last check that the mesh still serves and no KV leaked.

Each bug the fuzzing found keeps its minimal reproduction here (FOUND_BUGS, the body limit, the
huge prompt), so it stays fixed.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from dataclasses import dataclass

import hypothesis
import jsonschema_rs
import pytest
import requests
import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode

from services.common.sampling import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from services.gateway import openai_fields as oai_fields
from services.gateway.chat_template import ROLES
from services.gateway.openapi import openapi_document
from services.gateway.request import MAX_PROMPT_CHARS
from tests.fuzz.conftest import (
    MAX_TOKENS,
    RESPONSE_TIME_S,
    assert_still_serving_and_nothing_leaked,
    fuzz_settings,
)

# Each port its own seed: the edge forwards to the same gateway, so the two ports together
# send the gateway 2 x MAX_EXAMPLES different inputs, and Envoy MAX_EXAMPLES of them.
SEEDS = {"gateway": 20240611, "edge": 20240612}
MAX_EXAMPLES = 40
TARGETS = tuple(SEEDS)
MAX_BODY_BYTES = 8 * 2**20  # the default of the gateway and of Envoy (docs/api.md)
CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_headers_conformance",
    "response_schema_conformance",
    "negative_data_rejection",
]
_DOCUMENT = openapi_document("any")
# Every operation with data that fits the document; those that take a body also with data
# that does not (a path or no parameter at all leaves nothing to break).
OPERATIONS = [
    pytest.param(f"{method.upper()} {path}", mode, id=f"{method.upper()} {path} {mode}")
    for path, methods in _DOCUMENT["paths"].items()
    for method, op in methods.items()
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    if mode == GenerationMode.POSITIVE or "requestBody" in op
]


def _settings(max_examples: int = MAX_EXAMPLES) -> hypothesis.settings:
    return fuzz_settings(max_examples)


def _address(mesh, target: str) -> str:
    return mesh.gateway_http_address if target == "gateway" else mesh.edge_address


@pytest.fixture(scope="module")
def schemas(fuzz_mesh):
    """The document each port serves, loaded by schemathesis, with the checks to run."""
    out = {}
    for target in TARGETS:
        url = f"http://{_address(fuzz_mesh, target)}/openapi.json"
        schema = schemathesis.openapi.from_url(url, timeout=RESPONSE_TIME_S)
        schema.config.checks.update(included_check_names=CHECKS, max_response_time=RESPONSE_TIME_S)
        out[target] = schema
    return out


def test_both_ports_serve_the_same_document(fuzz_mesh):
    docs = [
        requests.get(f"http://{_address(fuzz_mesh, t)}/openapi.json", timeout=10).json()
        for t in TARGETS
    ]
    assert docs[0] == docs[1]
    assert docs[0]["paths"].keys() == _DOCUMENT["paths"].keys()


@pytest.mark.parametrize(("label", "mode"), OPERATIONS)
@pytest.mark.parametrize("target", TARGETS)
def test_every_operation_answers_as_its_document_says(schemas, target, label, mode):
    operation = schemas[target].find_operation_by_label(label)
    assert operation is not None, f"the served document lacks {label}"
    session = requests.Session()

    @hypothesis.seed(SEEDS[target])
    @_settings()
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        response = case.call(session=session, timeout=RESPONSE_TIME_S)
        case.validate_response(response)

    with session:
        fuzz()


@pytest.mark.parametrize("label", ["POST /v1/completions", "POST /v1/chat/completions"])
def test_a_streamed_reply_matches_the_document(schemas, label):
    operation = schemas["gateway"].find_operation_by_label(label)
    prompt = (
        {"prompt": "Hi"}
        if "chat" not in label
        else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    case = operation.Case(
        body={**prompt, "max_tokens": 2, "stream": True}, media_type="application/json"
    )
    case.call_and_validate(timeout=RESPONSE_TIME_S)


def test_the_document_admits_every_body_the_server_serves(fuzz_mesh):
    address = fuzz_mesh.gateway_http_address
    schemas = requests.get(f"http://{address}/openapi.json", timeout=10).json()["components"]
    hi = {"role": "user", "content": "hi"}
    served = [
        ("/v1/completions", "CompletionRequest", {"prompt": "x", "max_tokens": 2, "stop": None}),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": [hi], "user": None}),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": [{**hi, "name": None}]}),
    ]
    for path, name, body in served:
        r = requests.post(f"http://{address}{path}", json=body, timeout=RESPONSE_TIME_S)
        assert r.status_code == 200, r.text[:200]
        assert jsonschema_rs.validator_for(schemas["schemas"][name]).is_valid(body), body
    # What the document refuses, the server refuses: a chat message's name that is no string.
    odd = {"messages": [{**hi, "name": [1]}]}
    assert not jsonschema_rs.validator_for(schemas["schemas"]["ChatCompletionRequest"]).is_valid(
        odd
    )
    r = requests.post(f"http://{address}/v1/chat/completions", json=odd, timeout=RESPONSE_TIME_S)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text[:200]


# Raw bodies -------------------------------------------------------------------------------

SURROGATES = ("\ud800", "\udbff", "\udc00", "\udfff")
NASTY_STRINGS = (
    "",
    " ",
    "\x00",
    "\x00" * 3,
    "\u202e",
    "\r\n\r\n",
    "data: [DONE]\n\n",
    "<|im_end|>",
    "<|begin_of_text|>",
    "{{ 7 * 7 }}{% raise %}",
    "东京 café 🙂",
    "🙂" * 257,
    "a" * 257,
    "x" * 5000,
    *SURROGATES,
)
NASTY_NUMBERS = (
    0,
    -1,
    1,
    2,
    16,
    32,
    33,
    932,
    933,
    1023,
    1024,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**63 - 1,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    0.0,
    -0.0,
    0.5,
    1.0,
    1.5,
    5e-324,
    1e308,
    float("nan"),
    float("inf"),
    float("-inf"),
)
RAW_BODIES = (
    b"",
    b"null",
    b"[]",
    b'"prompt"',
    b"{",
    b"[" * 100_000,
    b'{"prompt": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",
    b'{"prompt": "x", "max_tokens": ' + b"9" * 5_000 + b"}",
    b'{"prompt": "x", "max_tokens": 1e999999}',
    b'{"prompt": "\\ud800", "max_tokens": 1}',
    b'{"prompt": "\xff\xfe", "max_tokens": 1}',
    b'\xef\xbb\xbf{"prompt": "x", "max_tokens": 1}',
    b'{"prompt": "x", "prompt": 5}',
)

strings = st.one_of(
    st.sampled_from(NASTY_STRINGS),
    st.text(max_size=30),
    st.lists(st.one_of(st.characters(), st.sampled_from(SURROGATES)), max_size=8).map("".join),
)
numbers = st.one_of(
    st.sampled_from(NASTY_NUMBERS), st.integers(), st.floats(allow_nan=True, allow_infinity=True)
)
scalars = st.one_of(st.none(), st.booleans(), numbers, strings)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(strings, inner, max_size=4),
    max_leaves=12,
)
VOCAB = 933  # the tiny model's
token_ids = st.lists(st.one_of(st.integers(0, VOCAB - 1), numbers), max_size=40)
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(ROLES), strings)},
    optional={
        "content": st.one_of(
            strings,
            st.none(),
            st.lists(
                st.fixed_dictionaries(
                    {"type": st.sampled_from(["text", "image_url"]), "text": strings}
                ),
                max_size=3,
            ),
            json_values,
        ),
        "name": st.one_of(strings, json_values),
    },
)
# Hostile values of each field: mostly of the field's own type (to get past the type checks).
HOSTILE = {
    "model": strings,
    "prompt": st.one_of(
        strings, token_ids, st.lists(strings, max_size=2), st.lists(token_ids, max_size=2)
    ),
    "messages": st.lists(message, max_size=4),
    "max_tokens": numbers,
    "max_completion_tokens": numbers,
    "temperature": numbers,
    "top_p": numbers,
    "top_k": numbers,
    "seed": numbers,
    "stop": st.one_of(strings, st.lists(strings, max_size=20)),
    "n": numbers,
    "stream": scalars,
    "stream_options": st.one_of(
        st.fixed_dictionaries({}, optional={"include_usage": scalars}), json_values
    ),
    "user": strings,
    "ignore_eos": scalars,
    "stop_token_ids": token_ids,
    "presence_penalty": numbers,
    "frequency_penalty": numbers,
    "repetition_penalty": numbers,
    "min_p": numbers,
    "min_tokens": numbers,
    "logit_bias": st.dictionaries(
        st.one_of(strings, st.integers().map(str), numbers.map(str)), scalars, max_size=4
    ),
    **{f.name: scalars for f in oai_fields.FIELDS if not f.honoured},
    "temprature": numbers,  # unknown fields are refused, naming the field meant
}
# Valid requests (short ones), for the hostile values to be mixed into.
plain_text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
VALID = {
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, VOCAB + 1),
    "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(
        plain_text.map(lambda s: s[:8]),
        st.lists(st.text(st.characters(codec="utf-8"), min_size=1, max_size=256), max_size=16),
    ),
    "n": st.just(1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": plain_text,
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=64),
    "logprobs": st.sampled_from([None, False, 0]),
}
VALID_PROMPT = {
    "/v1/completions": st.fixed_dictionaries(
        {
            "prompt": st.one_of(
                plain_text,
                st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
                plain_text.map(lambda s: [s]),
            )
        }
    ),
    "/v1/chat/completions": st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.fixed_dictionaries(
                    {
                        "role": st.sampled_from(["system", "user", "assistant"]),
                        "content": plain_text,
                    }
                ),
                min_size=1,
                max_size=3,
            )
        }
    ),
}


@st.composite
def bodies(draw, path: str) -> dict:
    """A valid request with up to three fields replaced by (or added as) hostile values."""
    body = draw(VALID_PROMPT[path]) | draw(st.fixed_dictionaries({}, optional=VALID))
    for name in draw(st.lists(st.sampled_from(sorted(HOSTILE)), max_size=3, unique=True)):
        body[name] = draw(st.one_of(HOSTILE[name], HOSTILE[name], json_values))
    return body


# What an HTTP client can send in a header: latin-1, no control characters, nothing to trim.
request_ids = st.one_of(
    st.none(),
    st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=140),
    st.text(st.characters(min_codepoint=0xA0, max_codepoint=0xFF), max_size=4),
).map(lambda s: s and s.strip())


@dataclass(frozen=True)
class FoundBug:
    """A wrong answer the fuzzing found (a 500), fixed: its minimal request now gets a 400
    naming the field."""

    name: str
    path: str
    body: bytes
    param: str


FOUND_BUGS = (
    # A lone surrogate (a valid JSON escape, but no Unicode text) reached the tokenizer.
    FoundBug("lone_surrogate_in_prompt", "/v1/completions", b'{"prompt": "\\ud800"}', "prompt"),
    FoundBug(
        "lone_surrogate_in_chat_content",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        "messages",
    ),
    # ... failed to encode to protobuf.
    FoundBug(
        "lone_surrogate_in_stop", "/v1/completions", b'{"prompt": "x", "stop": "\\ud800"}', "stop"
    ),
    # ... failed even in the error handler (the 404 body echoed it).
    FoundBug(
        "lone_surrogate_in_model",
        "/v1/completions",
        b'{"prompt": "x", "model": "\\ud800"}',
        "model",
    ),
    # top_k >= 2**32 passed validation, then did not fit the uint32 proto field.
    FoundBug(
        "top_k_past_uint32", "/v1/completions", b'{"prompt": "x", "top_k": 4294967296}', "top_k"
    ),
)


@pytest.mark.parametrize("bug", FOUND_BUGS, ids=lambda b: b.name)
def test_a_found_bug_stays_fixed(fuzz_mesh, bug):
    for target in TARGETS:
        r = requests.post(
            f"http://{_address(fuzz_mesh, target)}{bug.path}",
            data=bug.body,
            headers={"content-type": "application/json"},
            timeout=RESPONSE_TIME_S,
        )
        assert r.status_code == 400, (target, r.status_code, r.text[:300])
        assert r.json()["error"]["param"] == bug.param, r.text[:300]


def _check_answer(r: requests.Response) -> None:
    """No 5xx, errors in OpenAI's shape, whole streams."""
    assert r.status_code < 500, f"{r.status_code}: {r.text[:300]}"
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["message"] and error["type"], error
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        for event in events[:-1]:
            error = json.loads(event).get("error")
            assert error is None or error["type"] != "server_error", error
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("target", TARGETS)
def test_raw_bodies_never_get_a_server_error(fuzz_mesh, target, path):
    url = f"http://{_address(fuzz_mesh, target)}{path}"
    session = requests.Session()

    @hypothesis.seed(SEEDS[target])
    @_settings(max_examples=2 * MAX_EXAMPLES)
    @hypothesis.given(
        body=st.one_of(bodies(path), bodies(path), json_values, st.sampled_from(RAW_BODIES)),
        request_id=request_ids,
        walk_away=st.booleans(),
    )
    def fuzz(body, request_id, walk_away):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"content-type": "application/json"}
        if request_id is not None:
            headers["x-request-id"] = request_id
        with session.post(
            url, data=data, headers=headers, timeout=RESPONSE_TIME_S, stream=True
        ) as r:
            if walk_away and r.headers.get("content-type", "").startswith("text/event-stream"):
                next(r.iter_lines())  # the first event, then the client closes the connection
                return
            r.content  # noqa: B018 (reads the whole answer, within the timeout)
        _check_answer(r)

    with session:
        fuzz()


# The documented limits -------------------------------------------------------------------

CONTEXT = 1024  # the tiny model's
LIMITS = [
    ({"prompt": "a" * (MAX_PROMPT_CHARS + 1)}, "prompt"),
    ({"prompt": [5] * CONTEXT, "max_tokens": 1}, "prompt"),
    ({"prompt": "x", "max_tokens": MAX_TOKENS + 1}, "max_tokens"),
    ({"prompt": [5] * (CONTEXT - 8), "max_tokens": 9}, "max_tokens"),
    ({"prompt": "x", "stop": ["a"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"prompt": "x", "stop": ["a" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
    ({"prompt": "x", "stop": [""]}, "stop"),
    ({"prompt": "x", "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"prompt": "x", "seed": 2**63}, "seed"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "temperature": -0.5}, "temperature"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "min_tokens": 17}, "min_tokens"),  # over max_tokens (16)
    ({"prompt": "x", "logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
]
AT_THE_LIMITS = [
    {"prompt": [5] * (CONTEXT - 1), "max_tokens": 1},
    {"prompt": [5] * (CONTEXT - MAX_TOKENS), "max_tokens": MAX_TOKENS},
    {"prompt": "x", "max_tokens": 2, "stop": ["🙂" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS},
    {"prompt": "x", "max_tokens": 2, "stop_token_ids": [VOCAB - 1] * MAX_STOP_TOKEN_IDS},
    {"prompt": "x", "max_tokens": 2, "seed": 2**63 - 1, "top_p": 1e-9, "temperature": 1e-9},
    {
        "prompt": "x",
        "max_tokens": 2,
        "presence_penalty": -2,
        "frequency_penalty": 2,
        "repetition_penalty": 1e6,
        "min_p": 1,
        "min_tokens": 2,
        "logit_bias": {"0": 100, str(VOCAB - 1): -100},
    },
]


@pytest.mark.parametrize("target", TARGETS)
def test_each_documented_limit_gets_a_400_naming_its_field(fuzz_mesh, target):
    url = f"http://{_address(fuzz_mesh, target)}/v1/completions"
    for body, param in LIMITS:
        r = requests.post(url, json=body, timeout=RESPONSE_TIME_S)
        assert r.status_code == 400, (param, r.text[:300])
        assert r.json()["error"]["param"] == param, r.text[:300]
    for body in AT_THE_LIMITS:
        r = requests.post(url, json=body, timeout=RESPONSE_TIME_S)
        assert r.status_code == 200, (body.keys(), r.text[:300])


def test_envoy_answers_a_body_over_the_limit_with_413(fuzz_mesh):
    r = requests.post(
        f"http://{fuzz_mesh.edge_address}/v1/completions",
        data=b"x" * (MAX_BODY_BYTES + 1),
        headers={"content-type": "application/json"},
        timeout=RESPONSE_TIME_S,
    )
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_the_gateway_answers_a_body_over_the_limit_with_413(fuzz_mesh):
    r = requests.post(
        f"http://{fuzz_mesh.gateway_http_address}/v1/completions",
        data=b"x" * (MAX_BODY_BYTES + 1),
        headers={"content-type": "application/json"},
        timeout=RESPONSE_TIME_S,
    )
    assert r.status_code == 413, r.text[:200]
    assert r.json()["error"]["code"] == "request_too_large"


def test_the_mesh_still_serves_and_nothing_leaked(fuzz_mesh, lapsed_before):
    # The HTTP API has no deadlines: no request of this module leaves KV for its lease to lapse.
    assert_still_serving_and_nothing_leaked(fuzz_mesh, lapsed_before)


# Last: it keeps the gateway's tokenizer thread busy for seconds.
def test_a_huge_prompt_does_not_stall_other_requests(fuzz_mesh):
    url = f"http://{fuzz_mesh.gateway_http_address}/v1/completions"
    huge = {"prompt": "ab " * (MAX_PROMPT_CHARS // 3)}  # 4 Mi characters, 2.8 M tokens

    def post(body: dict) -> tuple[requests.Response, float]:
        r = requests.post(url, json=body, timeout=RESPONSE_TIME_S)
        return r, time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        refused = pool.submit(post, huge)
        time.sleep(0.5)  # the huge one is being tokenized now
        small, small_done = post({"prompt": "hi", "max_tokens": 2})
        refusal, refused_done = refused.result()
    assert refusal.status_code == 400 and refusal.json()["error"]["param"] == "prompt"
    assert small.status_code == 200, small.text[:200]
    # Not a timing bound: the small request was served while the huge one was still being
    # tokenized (a stalled event loop would have answered it only after the refusal).
    assert small_done < refused_done
