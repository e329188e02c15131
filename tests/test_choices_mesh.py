"""n > 1 and best_of through the mesh: the prompt is prefilled once and its KV pulled once, the
choices decode over it; 1P1D gives colocated's tokens per choice (and the engine's), greedy
choices are the single answer, best_of returns the choices of highest cumulative logprob, every
block is freed after finished and cancelled requests, and bad counts are refused by name. The
official `openai` client's n=3 works through Envoy."""

from __future__ import annotations

import asyncio
import json

import grpc
import openai
import pytest
import requests

from services.common.convert import logprobs_list_from_pb, sampling_from_pb
from services.common.gen.distserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    prefill_pb2_grpc,
)
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine

PROMPT = [1, 100, 200, 300, 400, 17, 18, 19, 20, 21]
SEEDED = dict(max_tokens=10, temperature=1.5, seed=7, ignore_eos=True, n=3)


async def _generate(address: str, prompt: list[int], fields: dict):
    """Each choice's token ids, logprobs and finish reasons by index, and the usage."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        req = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt),
            sampling=common_pb2.SamplingParams(**fields),
        )
        ids: dict[int, list[int]] = {}
        lps: dict[int, list] = {}
        reasons: dict[int, int] = {}
        usage = None
        async for r in stub.Generate(req, timeout=60):
            assert r.index not in reasons  # nothing after a choice's last response
            ids.setdefault(r.index, []).extend(r.token_ids)
            lps.setdefault(r.index, []).extend(logprobs_list_from_pb(r.logprobs))
            if r.finish_reason:
                reasons[r.index] = r.finish_reason
            if r.HasField("usage"):
                assert usage is None
                usage = r.usage
        return ids, lps, reasons, usage


def generate(address: str, fields: dict, prompt: list[int] = PROMPT):
    return asyncio.run(_generate(address, prompt, fields))


def stats(address: str, role: str):
    stub = prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub
    with grpc.insecure_channel(address) as channel:
        return stub(channel).Stats(common_pb2.StatsRequest(), timeout=5)


def address(mesh, role: str) -> str:
    return next(p.ready["address"] for p in mesh.workers if p.name.startswith(role))


def kv_all_free(mesh) -> bool:
    for p in mesh.workers:
        if p.popen.poll() is not None:  # killed by the test
            continue
        role = "prefill" if p.name.startswith("prefill") else "decode"
        s = stats(p.ready["address"], role)
        if s.load.free_kv_blocks != s.load.total_kv_blocks or s.load.held_kv_handles:
            return False
    return True


def wait_free(mesh, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not kv_all_free(mesh):
        assert time.monotonic() < deadline, "KV blocks still held"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def colocated(tiny_model):
    from tests.conftest import start_mesh, stop_now

    mesh = start_mesh(tiny_model, prefill=0, decode=0, colocated=1)
    yield mesh
    stop_now(mesh)


def test_seeded_n3_through_1p1d_equals_colocated_prefilled_and_pulled_once(
    shared_mesh, colocated, tiny_model
):
    prefill, decode = address(shared_mesh, "prefill"), address(shared_mesh, "decode")
    before = stats(prefill, "prefill").requests_total, stats(decode, "decode").pulls_total
    ids, _, reasons, usage = generate(shared_mesh.gateway_address, SEEDED)
    assert stats(prefill, "prefill").requests_total == before[0] + 1  # one prefill
    assert stats(decode, "decode").pulls_total == before[1] + 1  # one pull
    assert sorted(ids) == [0, 1, 2] and len({tuple(t) for t in ids.values()}) == 3
    assert all(len(t) == 10 for t in ids.values()) and len(reasons) == 3
    assert usage.prompt_tokens == len(PROMPT) and usage.completion_tokens == 30
    assert generate(colocated.gateway_address, SEEDED)[0] == ids
    # The in-process engine: the same choices.
    engine = LLMEngine(tiny_model, EngineConfig(num_blocks=256), detokenize=False)
    params = sampling_from_pb(common_pb2.SamplingParams(**SEEDED))
    assert {c.index: c.token_ids for c in engine.generate([PROMPT], params)} == ids
    wait_free(shared_mesh)


def test_greedy_choices_equal_the_single_answer(shared_mesh):
    greedy = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    one = generate(shared_mesh.gateway_address, greedy)[0]
    two = generate(shared_mesh.gateway_address, {**greedy, "n": 2})[0]
    assert two == {0: one[0], 1: one[0]}


def test_best_of_returns_the_choices_of_highest_cumulative_logprob(shared_mesh):
    fields = dict(max_tokens=6, temperature=1.5, seed=3, ignore_eos=True)
    _, every, _, _ = generate(shared_mesh.gateway_address, {**fields, "n": 4, "logprobs": 0})
    totals = {i: sum(lp.logprob for lp in lps) for i, lps in every.items()}
    ranked = sorted(totals, key=lambda i: -totals[i])
    ids, lps, reasons, _ = generate(
        shared_mesh.gateway_address, {**fields, "n": 2, "best_of": 4, "logprobs": 0}
    )
    assert sorted(ids) == [0, 1] and len(reasons) == 2
    got = [sum(lp.logprob for lp in lps[i]) for i in (0, 1)]
    assert got == pytest.approx([totals[ranked[0]], totals[ranked[1]]], abs=1e-5)
    assert got[0] >= got[1]
    # Without logprobs asked, none are returned (the ranking asked for them itself).
    ids2, lps2, _, _ = generate(shared_mesh.gateway_address, {**fields, "n": 2, "best_of": 4})
    assert ids2 == ids and all(not v for v in lps2.values())
    wait_free(shared_mesh)


def test_cancelled_choices_free_every_block(shared_mesh, colocated):
    for mesh in (shared_mesh, colocated):

        async def cancel_after_first(mesh=mesh) -> None:
            async with grpc.aio.insecure_channel(mesh.gateway_address) as channel:
                stub = gateway_pb2_grpc.GatewayStub(channel)
                sampling = common_pb2.SamplingParams(
                    max_tokens=200, temperature=1.0, ignore_eos=True, n=4
                )
                call = stub.Generate(
                    gateway_pb2.GenerateRequest(text="a long answer", sampling=sampling)
                )
                seen = 0
                async for r in call:
                    seen += len(r.token_ids)
                    if seen >= 8:
                        call.cancel()
                        break

        asyncio.run(cancel_after_first())
        wait_free(mesh)


BAD = [
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 2, "stream": True}, "best_of"),
]


@pytest.mark.parametrize(("fields", "param"), BAD, ids=["n0", "n17", "best_of<n", "stream"])
def test_bad_choice_counts_are_refused_by_name(shared_mesh, fields, param):
    r = requests.post(
        f"http://{shared_mesh.gateway_http_address}/v1/completions",
        json={"prompt": "x", **fields},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    if param != "best_of" or "stream" not in fields:
        assert "16" in r.json()["error"]["message"]


def test_grpc_refuses_n_above_16(shared_mesh):
    with grpc.insecure_channel(shared_mesh.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        sampling = common_pb2.SamplingParams(max_tokens=4, n=17)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(gateway_pb2.GenerateRequest(text="x", sampling=sampling)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "n must be an integer in [1, 16]" in err.value.details()


def test_openai_client_n3_through_envoy_streamed_and_whole(shared_mesh):
    client = openai.OpenAI(
        base_url=f"http://{shared_mesh.edge_address}/v1", api_key="none", max_retries=0
    )
    model = shared_mesh.spec.model.resolve().name
    common = dict(model=model, max_tokens=8, temperature=1.2, seed=5, n=3)
    extra = {"ignore_eos": True}
    whole = client.completions.create(prompt="The mesh", logprobs=1, extra_body=extra, **common)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert all(len(c.logprobs.tokens) == 8 for c in whole.choices)
    assert len({c.text for c in whole.choices}) > 1
    assert whole.usage.completion_tokens == 24
    texts = {i: "" for i in range(3)}
    ended = {}
    for chunk in client.completions.create(
        prompt="The mesh", stream=True, extra_body=extra, **common
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                ended[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert ended == {0: "length", 1: "length", 2: "length"}

    messages = [{"role": "user", "content": "What does decode do?"}]
    chat = client.chat.completions.create(messages=messages, extra_body=extra, **common)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert chat.usage.completion_tokens == 24
    content = {i: "" for i in range(3)}
    stream = client.chat.completions.create(
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
        **common,
    )
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            content[c.index] += c.delta.content or ""
    assert content == {c.index: c.message.content for c in chat.choices}
    assert usage.completion_tokens == 24 and usage.prompt_tokens == chat.usage.prompt_tokens
    wait_free(shared_mesh)


def test_whole_reply_has_one_choice_per_index(shared_mesh):
    r = requests.post(
        f"http://{shared_mesh.gateway_http_address}/v1/completions",
        json={"prompt": PROMPT, "n": 2, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        timeout=30,
    )
    body = r.json()
    assert r.status_code == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["choices"][0]["text"] == body["choices"][1]["text"]
    assert body["usage"]["completion_tokens"] == 8
    json.dumps(body)


def test_a_lost_decode_instance_ends_several_choices_with_a_retryable_error(mesh_factory):
    """Choices do not move one by one: the request ends UNAVAILABLE (retryable), saying so,
    and nothing stays held on the instances left."""
    import signal

    mesh = mesh_factory(prefill=1, decode=2)
    sampling = common_pb2.SamplingParams(max_tokens=400, ignore_eos=True, n=2)
    request = gateway_pb2.GenerateRequest(text="The decode phase adds", sampling=sampling)
    with grpc.insecure_channel(mesh.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        seen = 0
        with pytest.raises(grpc.RpcError) as err:
            for r in stub.Generate(request, timeout=60):
                seen += len(r.token_ids)
                if seen >= 8 and seen - len(r.token_ids) < 8:
                    victim = next(
                        p
                        for p in mesh.workers
                        if p.name.startswith("decode")
                        and stats(p.ready["address"], "decode").load.running_seqs
                    )
                    victim.popen.send_signal(signal.SIGKILL)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "send the request again" in err.value.details()
    victim.popen.wait(timeout=5)
    wait_free(mesh)  # the instances left
