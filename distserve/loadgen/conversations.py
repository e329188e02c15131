"""Multi-turn conversations sharing one system prompt, the workload of prefix caching and
KV-aware routing (bench/prefix/prefix.py, bench/gateways/gateways.py): each turn's prompt is the
whole conversation so far, so a prefill instance that served an earlier turn holds most of it.

    talks = Conversations(64, vocab_size, seed=7)
    turns = asyncio.run(converse(address, talks, rate=16, scale=6, answer=64, seed=7))
    prefix_hit_fraction(mesh)  # prompt tokens reused / the most any instance held, all gateways
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import grpc
import numpy as np

from distserve.loadgen.requests import FIRST_ORDINARY_ID, poisson_arrivals
from distserve.loadgen.scrape import role_total, total
from services.common import mesh_tls
from services.common.gen.distserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

SYSTEM, USER, TURNS = 1000, 100, 6  # tokens of the shared system prompt, of a user message; turns
THINK_S = 1.0  # emulated s between an answer and the next turn
# The routing workload at scale (emulated): conversations started at RATE a second, answers of
# ANSWER_AT_SCALE tokens, the conversations' seed.
CONVERSATIONS_AT_SCALE, ANSWER_AT_SCALE, RATE, SEED = 64, 64, 16.0, 7


@dataclass
class Turn:
    conversation: int
    turn: int
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    ttft_s: float = float("nan")
    tpot_s: float = float("nan")
    error: str = ""


class Conversations:
    """Token-level conversations: a shared system prompt, then per conversation its user
    messages (seeded) and the answers the mesh gave."""

    def __init__(self, n: int, vocab: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.system = rng.integers(FIRST_ORDINARY_ID, vocab, SYSTEM).tolist()
        self.users = [
            [rng.integers(FIRST_ORDINARY_ID, vocab, USER).tolist() for _ in range(TURNS)]
            for _ in range(n)
        ]
        self.history: list[list[int]] = [list(self.system) for _ in range(n)]

    def prompt(self, c: int, turn: int) -> list[int]:
        self.history[c] += self.users[c][turn]
        return list(self.history[c])

    def answered(self, c: int, tokens: list[int]) -> None:
        self.history[c] += tokens


async def ask(
    stub: gateway_pb2_grpc.GatewayStub, turn: Turn, prompt: list[int], answer: int, scale: float
) -> Turn:
    """One turn through the gateway: its tokens, TTFT and TPOT (emulated s when scale > 1)."""
    request = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=prompt),
        sampling=common_pb2.SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True),
    )
    start = time.monotonic()
    first = None
    try:
        async for r in stub.Generate(request, timeout=600):
            if r.token_ids and first is None:
                first = time.monotonic()
            turn.tokens += r.token_ids
    except grpc.aio.AioRpcError as e:
        turn.error = f"{e.code().name}: {e.details()}"
        return turn
    end = time.monotonic()
    turn.ttft_s = (first - start) / scale
    if len(turn.tokens) > 1:
        turn.tpot_s = (end - first) / (len(turn.tokens) - 1) / scale
    return turn


async def converse(
    address: str, talks: Conversations, rate: float, scale: float, answer: int, seed: int
) -> list[Turn]:
    """Every conversation of `talks` through the gateway (or Envoy) at `address`: they start at
    Poisson times (`rate` a second), each turn waits for the answer before it, THINK_S apart;
    times in emulated seconds (`scale` wall seconds each)."""
    starts = poisson_arrivals(np.random.default_rng(seed + 1), rate, len(talks.users))
    turns: list[Turn] = []

    async def one(stub: gateway_pb2_grpc.GatewayStub, c: int) -> None:
        await asyncio.sleep(starts[c] * scale)
        for k in range(TURNS):
            prompt = talks.prompt(c, k)
            t = await ask(stub, Turn(c, k, len(prompt)), prompt, answer, scale)
            turns.append(t)
            if t.error:
                return
            talks.answered(c, t.tokens)
            await asyncio.sleep(THINK_S * scale)

    async with mesh_tls.aio_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        await asyncio.gather(*(one(stub, c) for c in range(len(talks.users))))
    return turns


def prefix_tokens(mesh) -> dict[str, float]:
    """Prompt tokens so far: those the prefill instances reused from their cache (`cached`) and
    computed (`computed`); of the prefill instances each request was routed to, the most any
    instance held of its prompt (`best`) and what the chosen one held (`chosen`), summed over
    every gateway (each counts the requests it routed)."""
    samples = [s for g in mesh.gateways for s in g.metrics()]
    name = "distserve_gateway_prefix_tokens_total"
    return {
        "cached": role_total(mesh, "prefill", "distserve_prompt_tokens_cached_total"),
        "computed": role_total(mesh, "prefill", "distserve_prompt_tokens_computed_total"),
        "best": total(samples, name, role="prefill", kind="best"),
        "chosen": total(samples, name, role="prefill", kind="cached"),
    }
