"""The layer-wise handoff through a real mesh: decode pulls each layer while prefill computes the
rest; exact tokens; the first token ending the request, and a cancel mid-prefill, leave nothing
held anywhere."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from distserve.local_mesh import Mesh, MeshSpec
from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from tests.conftest import stop_now
from tests.test_mesh import kv_all_free, wait_until

# Deep and wide enough that a long prompt's prefill takes a while on one core (12 layers).
DEEP = {"num_hidden_layers": 12, "hidden_size": 256, "intermediate_size": 768}
PROMPT = [5 + (i * 7) % 900 for i in range(900)]
LAYERWISE_MIN = 100  # shorter prompts hand off after prefill even in layer-wise mode
WORKER_ARGS = ("--kv-cache-gib", "0.0625", "--max-num-seqs", "8")


@pytest.fixture(scope="module")
def deep_model(model_factory):
    return model_factory("deep", **DEEP)


@pytest.fixture(scope="module", params=["layerwise", "after-prefill"])
def mesh(request, deep_model):
    spec = MeshSpec(
        model=deep_model,
        gateway_port=0,
        pin=True,
        worker_args=WORKER_ARGS,
        gateway_args=("--kv-handoff", request.param, "--layerwise-min-tokens", str(LAYERWISE_MIN)),
    )
    m = Mesh(spec)
    m.start()
    m.handoff = request.param
    yield m
    stop_now(m)


async def generate(address: str, prompt: list[int], max_tokens: int) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        params = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=params
        )
        return [t async for r in stub.Generate(request) for t in r.token_ids]


def overlap(mesh) -> tuple[float, float]:
    """(sum, count) of the decode instance's kv overlap fractions."""
    [decode] = [p for p in mesh.workers if p.name.startswith("decode")]
    body = urllib.request.urlopen(f"http://{decode.ready['metrics_address']}/metrics").read()
    values = {
        s.name: s.value
        for f in text_string_to_metric_families(body.decode())
        for s in f.samples
        if s.name.startswith("distserve_kv_overlap_fraction")
    }
    return values["distserve_kv_overlap_fraction_sum"], values[
        "distserve_kv_overlap_fraction_count"
    ]


def test_tokens_are_exact_and_layerwise_pulls_hide_behind_prefill(mesh, deep_model):
    engine = LLMEngine(deep_model, EngineConfig(num_blocks=256), detokenize=False)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    [expected] = engine.generate([PROMPT], params)
    before = overlap(mesh)
    for _ in range(2):
        assert asyncio.run(generate(mesh.gateway_address, PROMPT, 8)) == expected.token_ids
    total, count = (a - b for a, b in zip(overlap(mesh), before, strict=True))
    assert count == 2
    if mesh.handoff == "layerwise":
        # Most of each pull ran while prefill was still computing later layers.
        assert total / count > 0.5
    else:
        assert total == 0


def test_a_short_prompt_hands_off_after_prefill(mesh, deep_model):
    short = PROMPT[: LAYERWISE_MIN - 1]
    engine = LLMEngine(deep_model, EngineConfig(num_blocks=256), detokenize=False)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    [expected] = engine.generate([short], params)
    before = overlap(mesh)
    assert asyncio.run(generate(mesh.gateway_address, short, 4)) == expected.token_ids
    total, count = (a - b for a, b in zip(overlap(mesh), before, strict=True))
    assert (total, count) == (0, 1)  # pulled once, none of it while prefill computed


def test_a_first_token_that_ends_the_request_frees_everything(mesh):
    assert len(asyncio.run(generate(mesh.gateway_address, PROMPT, 1))) == 1
    wait_until(lambda: kv_all_free(mesh), what="KV freed after a one-token request")


def test_a_cancel_while_prefill_computes_frees_both_sides(mesh):
    async def cancel_during_prefill():
        task = asyncio.ensure_future(generate(mesh.gateway_address, PROMPT, 50))
        await asyncio.sleep(0.15)  # the prompt is being computed (and pulled, layer-wise)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_during_prefill())
    wait_until(lambda: kv_all_free(mesh), what="KV freed after a cancel mid-prefill")
    # And the mesh still serves.
    assert len(asyncio.run(generate(mesh.gateway_address, PROMPT[:50], 3))) == 3
