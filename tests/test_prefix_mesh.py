"""Prefix caching through the mesh (real engine, tiny model, real processes): a conversation's
second turn is routed to the prefill instance holding its first, computes only what is new
there, and the decode instance pulls only the blocks it lacks; tokens equal an engine without a
cache; nothing stays referenced after the turns."""

from __future__ import annotations

import asyncio

import grpc

from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from tests.conftest import MESH_WORKER_ARGS
from tests.test_mesh import addresses, kv_all_free, stats, wait_until

BS = 16  # the workers' default block size
FIRST = [3 + (11 * i) % 500 for i in range(80)]  # 5 full blocks
ANSWER = 8
NEW = [7 + (5 * i) % 300 for i in range(20)]


async def _generate(address: str, prompt: list[int], max_tokens: int) -> list[int]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        params = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        request = gateway_pb2.GenerateRequest(
            token_ids=gateway_pb2.TokenIds(ids=prompt), sampling=params
        )
        ids: list[int] = []
        async for r in stub.Generate(request):
            ids += r.token_ids
        return ids


def _uncached(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The independent reference: an engine with no prefix cache, each prompt alone."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = []
    for p in prompts:
        engine = LLMEngine(model, EngineConfig(num_blocks=64, prefix_cache=False))
        out.append(engine.generate([p], params)[0].token_ids)
    return out


def _totals(mesh, role: str, field: str) -> list[int]:
    return [getattr(stats(a, role), field) for a in addresses(mesh, role)]


def test_second_turns_reuse_their_first_on_prefill_and_on_decode(mesh_factory, tiny_model):
    """Two conversations' first turns at once land on the two prefill instances (the second
    finds the first's prompt queued on one); their second turns, one after the other on an
    idle mesh, each go to the instance holding its first (least-loaded routing would send both
    to the first instance) and compute only what is new."""
    mesh = mesh_factory(prefill=2, decode=1)
    other = [9 + (13 * i) % 400 for i in range(80)]

    async def first_turns():
        return await asyncio.gather(
            _generate(mesh.gateway_address, FIRST, ANSWER),
            _generate(mesh.gateway_address, other, ANSWER),
        )

    answers = asyncio.run(first_turns())
    assert sorted(_totals(mesh, "prefill", "requests_total")) == [1, 1]
    pulled_first = sum(_totals(mesh, "decode", "pull_bytes_total"))  # 2 x 5 blocks
    seconds = [[*p, *a, *NEW] for p, a in zip((FIRST, other), answers, strict=True)]
    tokens = [asyncio.run(_generate(mesh.gateway_address, p, ANSWER)) for p in seconds]
    reference = _uncached(tiny_model, [FIRST, other, *seconds], ANSWER)
    assert [*answers, *tokens] == reference

    # Prefill: each second turn (108 tokens) reused its first turn's 5 full blocks and
    # computed the 28 tokens after them, on the instance that had computed the first.
    assert _totals(mesh, "prefill", "requests_total") == [2, 2]
    assert _totals(mesh, "prefill", "prompt_tokens_cached") == [80, 80]
    assert _totals(mesh, "prefill", "prompt_tokens_computed") == [80 + 28, 80 + 28]
    # Decode held each first turn's prompt and answer (88 tokens: 5 full blocks): of each
    # second prompt's 7 blocks it pulled the last 2.
    assert _totals(mesh, "decode", "prompt_tokens_cached") == [160]
    pulled_second = sum(_totals(mesh, "decode", "pull_bytes_total")) - pulled_first
    assert pulled_second * 5 == pulled_first * 2
    # Cached blocks stay, unreferenced: every block is free for new work, no handle is held.
    wait_until(lambda: kv_all_free(mesh), what="KV unreferenced on both sides")
    assert all(n >= 5 for n in _totals(mesh, "prefill", "prefix_cache_blocks"))


def test_no_prefix_cache_computes_and_pulls_every_turn_whole(mesh_factory, tiny_model):
    mesh = mesh_factory(prefill=1, decode=1, worker_args=(*MESH_WORKER_ARGS, "--no-prefix-cache"))
    answer = asyncio.run(_generate(mesh.gateway_address, FIRST, ANSWER))
    second = [*FIRST, *answer, *NEW]
    tokens = asyncio.run(_generate(mesh.gateway_address, second, ANSWER))
    assert [answer, tokens] == _uncached(tiny_model, [FIRST, second], ANSWER)
    assert _totals(mesh, "prefill", "prompt_tokens_cached") == [0]
    assert _totals(mesh, "prefill", "prompt_tokens_computed") == [80 + 108]
    assert _totals(mesh, "decode", "prompt_tokens_cached") == [0]
    assert _totals(mesh, "prefill", "prefix_cache_blocks") == [0]
    wait_until(lambda: kv_all_free(mesh), what="KV freed on both sides")
