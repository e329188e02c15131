"""Penalties, logit_bias and min_tokens through the mesh: the first token is sampled on the
prefill instance and the rest on the decode instance (their counts start from the prompt and that
first token), and the answer equals the colocated engine's. Bad values are refused by name, with
the same message, on both APIs."""

from __future__ import annotations

import asyncio
import http.client
import json

import grpc
import pytest

from services.common.convert import sampling_from_pb
from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.presets import EOS_ID

PROMPTS = [[0, 100, 200, 300, 400], [0, 114, 222, 326], [0, 156, 288, 404]]
FORCED = 777  # a token the logit bias makes the first one (sampled by prefill)
SAMPLING = {
    "penalties": dict(
        max_tokens=32, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5,
        frequency_penalty=0.5,
    ),
    # Prefill's first token is FORCED; decode must count it, so that the frequency penalty
    # wears its bias down after the same number of repeats as in one engine.
    "bias-counted-across-the-handoff": dict(
        max_tokens=24, ignore_eos=True, logit_bias={FORCED: 5.0}, frequency_penalty=1.5,
    ),
    # EOS is favoured but masked for 12 tokens, on prefill (the first) and on decode.
    "min-tokens": dict(max_tokens=32, min_tokens=12, logit_bias={EOS_ID: 8.0}),
}  # fmt: skip


async def generate(address: str, prompt: list[int], sampling: common_pb2.SamplingParams):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        req = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=sampling
        )
        ids, last = [], None
        async for r in stub.Generate(req, timeout=60):
            ids += r.token_ids
            last = r
        return ids, last


@pytest.fixture(scope="module")
def colocated_answers(tiny_model):
    """Each case's greedy answers from one engine (the colocated worker's), with the values
    as the mesh carries them (float32 in the proto)."""
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=256))
    out = {}
    for case, fields in SAMPLING.items():
        params = sampling_from_pb(common_pb2.SamplingParams(temperature=0.0, **fields))
        out[case] = [c.token_ids for c in engine.generate(PROMPTS, params)]
    return out


@pytest.mark.parametrize("shape", ["1P1D", "colocated"])
def test_greedy_with_penalties_through_the_mesh_equals_the_colocated_engine(
    shared_mesh, mesh_factory, colocated_answers, shape
):
    mesh = shared_mesh if shape == "1P1D" else mesh_factory(prefill=0, decode=0, colocated=1)

    async def run_all():
        calls = [
            generate(mesh.gateway_address, prompt, common_pb2.SamplingParams(**fields))
            for fields in SAMPLING.values()
            for prompt in PROMPTS
        ]
        return await asyncio.gather(*calls)

    results = iter(asyncio.run(run_all()))
    for case, fields in SAMPLING.items():
        for prompt, want in zip(PROMPTS, colocated_answers[case], strict=True):
            ids, last = next(results)
            assert ids == want, f"{case}: prompt {prompt} diverged"
            assert last.usage.completion_tokens == len(want)
            if case == "bias-counted-across-the-handoff":
                assert ids[0] == FORCED and 1 < ids.count(FORCED) < 6
            if case == "min-tokens":
                assert len(ids) == fields["min_tokens"] + 1 and ids[-1] == EOS_ID
                assert last.finish_reason == common_pb2.FINISH_REASON_STOP


BAD = [
    ({"presence_penalty": 3.5}, "presence_penalty", "presence_penalty must be"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "frequency_penalty must be"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "repetition_penalty must be"),
    ({"min_p": 1.5}, "min_p", "min_p must be"),
    ({"min_tokens": 9}, "min_tokens", "min_tokens must be in [0, max_tokens]"),
    ({"logit_bias": {99999: 1.0}}, "logit_bias", "token id 99999, outside the vocabulary"),
    ({"logit_bias": {5: 101.0}}, "logit_bias", "in [-100, 100]"),
]


@pytest.mark.parametrize(("fields", "param", "message"), BAD, ids=[b[1] for b in BAD])
def test_bad_values_are_refused_by_name_with_one_message_on_both_apis(
    shared_mesh, fields, param, message
):
    sampling = common_pb2.SamplingParams(max_tokens=8, **fields)
    with grpc.insecure_channel(shared_mesh.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            list(
                stub.Generate(gateway_pb2.GenerateRequest(text="x", sampling=sampling), timeout=10)
            )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()

    body = {"prompt": "x", "max_tokens": 8}
    body |= {
        k: {str(t): b for t, b in v.items()} if isinstance(v, dict) else v
        for k, v in fields.items()
    }
    conn = http.client.HTTPConnection(shared_mesh.gateway_http_address, timeout=30)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
        )
        reply = conn.getresponse()
        status, error = reply.status, json.loads(reply.read())["error"]
    finally:
        conn.close()
    assert status == 400 and error["param"] == param
    assert error["message"] == err.value.details()  # one validation, one message
