"""Logprobs through the mesh: the first token's are computed by prefill and reach the client in
prefill's reply, the rest come from decode, the prompt's from prefill; the answer, logprobs
included, is the colocated engine's whether prefill and decode share an instance or not, on the
gRPC API and the OpenAI API (streamed or not). Bad values are refused by name on both."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import requests

from services.common.convert import logprobs_list_from_pb, sampling_from_pb
from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine

PROMPTS = [[1, 100, 200, 300, 400], [1, 114, 222, 326, 17, 18]]
SAMPLING = {
    "greedy": dict(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=3),
    # Processors change the choice, not the logprobs (the raw distribution's).
    "penalized-biased": dict(
        max_tokens=10, temperature=0.0, ignore_eos=True, frequency_penalty=1.0,
        logit_bias={777: 4.0}, logprobs=2,
    ),
    # Seeded sampling: decode's draws continue from prefill's (Sequence.skip_draw).
    "seeded": dict(max_tokens=10, temperature=1.5, seed=5, ignore_eos=True, logprobs=2),
}  # fmt: skip


async def generate(address: str, prompt: list[int], fields: dict):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        req = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(**fields),
        )
        ids, logprobs, prompt_lps = [], [], None
        async for r in stub.Generate(req, timeout=60):
            ids += r.token_ids
            logprobs += logprobs_list_from_pb(r.logprobs)
            if r.prompt_logprobs:
                assert prompt_lps is None  # once, on the first response
                prompt_lps = list(logprobs_list_from_pb(r.prompt_logprobs))
        return ids, logprobs, prompt_lps


@pytest.fixture(scope="module")
def engine_answers(tiny_model):
    """Each case's answers from one engine, as the colocated worker runs it."""
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=256))
    out = {}
    for case, fields in SAMPLING.items():
        params = sampling_from_pb(common_pb2.SamplingParams(**fields))
        answers = []
        for prompt in PROMPTS:  # one at a time, as the mesh test sends them
            rid = engine.add_request(prompt, params)
            ids, lps, prompt_lps = [], [], None
            while engine.has_unfinished():
                for o in engine.step():
                    if o.request_id == rid:
                        ids += o.new_token_ids
                        lps += o.logprobs or []
                        prompt_lps = prompt_lps or o.prompt_logprobs
            answers.append((ids, lps, prompt_lps))
        out[case] = answers
    return out


def close(a, b) -> bool:
    """Two positions' logprobs: the same tokens, values equal to float32 rounding."""
    return (
        a.token_id == b.token_id
        and a.rank == b.rank
        and a.top_ids == b.top_ids
        and abs(a.logprob - b.logprob) < 1e-5
        and all(abs(x - y) < 1e-5 for x, y in zip(a.top_logprobs, b.top_logprobs, strict=True))
    )


@pytest.mark.parametrize("shape", ["1P1D", "colocated"])
def test_logprobs_through_the_mesh_equal_the_colocated_engines(
    shared_mesh, mesh_factory, engine_answers, shape
):
    mesh = shared_mesh if shape == "1P1D" else mesh_factory(prefill=0, decode=0, colocated=1)
    for case, fields in SAMPLING.items():
        for prompt, (want_ids, want_lps, want_prompt) in zip(
            PROMPTS, engine_answers[case], strict=True
        ):
            ids, lps, prompt_lps = asyncio.run(generate(mesh.gateway_address, prompt, fields))
            assert ids == want_ids, f"{case}: {prompt} diverged"
            assert len(lps) == len(ids) == fields["max_tokens"]
            assert all(close(a, b) for a, b in zip(lps, want_lps, strict=True)), case
            assert [lp.token_id for lp in lps] == ids
            assert all(len(lp.top_ids) == fields["logprobs"] for lp in lps)
            if "prompt_logprobs" in fields:
                assert [lp.token_id for lp in prompt_lps] == prompt[1:]
                assert all(close(a, b) for a, b in zip(prompt_lps, want_prompt, strict=True))
            else:
                assert prompt_lps is None


def post(address: str, path: str, body: dict):
    r = requests.post(f"http://{address}{path}", json=body, timeout=60)
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.content.decode().split("\n") if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return r.status_code, [json.loads(e) for e in events[:-1]]
    return r.status_code, r.json()


def test_openai_logprobs_streamed_equal_whole_and_echo_scores_the_prompt(shared_mesh):
    address = shared_mesh.gateway_http_address
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "logprobs": 3, "echo": True}  # fmt: skip
    status, whole = post(address, "/v1/completions", body)
    assert status == 200, whole
    choice = whole["choices"][0]
    lp = choice["logprobs"]
    n = len(PROMPTS[0]) + 8
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(len(t) in (3, 4) for t in lp["top_logprobs"][1:])  # top 3, and the chosen one
    offsets = [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    assert lp["text_offset"] == offsets
    assert [p and next(iter(p)) for p in choice["prompt_logprobs"]][1:] == [
        str(t) for t in PROMPTS[0][1:]
    ]
    status, chunks = post(address, "/v1/completions", {**body, "stream": True})
    streamed = {k: [] for k in lp}
    for c in chunks:
        if c["choices"] and c["choices"][0]["logprobs"]:
            for k in lp:
                streamed[k] += c["choices"][0]["logprobs"][k]
    assert streamed == lp
    assert chunks[0]["choices"][0]["prompt_logprobs"] == choice["prompt_logprobs"]

    chat = {"messages": [{"role": "user", "content": "What does prefill do?"}],
            "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 2}  # fmt: skip
    status, whole = post(address, "/v1/chat/completions", chat)
    content = whole["choices"][0]["logprobs"]["content"]
    assert status == 200 and len(content) == 6
    assert all(len(c["top_logprobs"]) == 2 for c in content)
    assert all(c["top_logprobs"][0]["logprob"] >= c["logprob"] for c in content)
    status, chunks = post(address, "/v1/chat/completions", {**chat, "stream": True})
    streamed = [e for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for e in c["choices"][0]["logprobs"]["content"]]  # fmt: skip
    assert streamed == content


BAD = [
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
]


@pytest.mark.parametrize(("path", "fields", "param"), BAD, ids=[f"{b[2]}-{b[0]}" for b in BAD])
def test_bad_logprobs_are_refused_by_name(shared_mesh, path, fields, param):
    prompt = {"prompt": "x"} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "x"}]
    }  # fmt: skip
    status, reply = post(shared_mesh.gateway_http_address, path, {**prompt, **fields})
    assert status == 400 and reply["error"]["param"] == param, reply


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_grpc_refuses_more_than_20_alternatives_by_name(shared_mesh, name):
    sampling = common_pb2.SamplingParams(max_tokens=4, **{name: 21})
    with grpc.insecure_channel(shared_mesh.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(
                stub.Generate(gateway_pb2.GenerateRequest(text="x", sampling=sampling), timeout=10)
            )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{name} must be an integer in [0, 20]" in err.value.details()
