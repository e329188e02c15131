"""The chaos bench's load: the seeded plan of requests (Poisson arrivals, prompts, lengths,
client cancellations), each prompt's reference tokens from the in-process engine, and the client
that sends, cancels and classifies each request (`bench/chaos/chaos.py` says what the classes
mean)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from services.common.gen.distserve.v1 import (
    common_pb2,
    gateway_pb2,
)
from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine

PROMPTS = (
    "Hello",
    "The decode phase adds one token at a time",
    "A longer prompt: " + "prefill reads the whole prompt at once and writes the cache; " * 6,
    "東京 café 🙂",
    "Short",
    "Goodput is requests per second that meet both SLOs",
    "Disaggregation moves the KV cache " * 12,
    "def f(x):\n    return x * 2\n" * 4,
)
MAX_TOKENS = (16, 32, 64, 128, 256, 512)  # long streams: a decode fault cuts some off
CANCEL_WITHIN_S = 0.05  # an early cancel comes 0-50 ms after sending
LOST_STATUSES = ("UNKNOWN", "INTERNAL", "DEADLINE_EXCEEDED")


@dataclass(frozen=True)
class ChaosSpec:
    """The chaos bench's settings: one field a flag of `bench/chaos/chaos.py`."""

    duration_s: float = 300.0
    rate: float = 6.0
    seed: int = 0
    cancellations: int | None = 1000
    cancel_fraction: float = 0.25
    prefill: int = 2
    decode: int = 2
    fault_interval_s: float = 8.0  # mean gap between worker faults
    restart_delay_s: float = 1.0
    sigkill_fraction: float = 0.5  # the rest get SIGTERM (drain)
    drain_timeout_s: float = 1.0
    lease_s: float = 4.0
    transfer_fault_every: int = 25
    fuzz_bodies: int = 50
    bound_s: float = 60.0
    baseline: bool = True  # run the fault-free baseline first (for goodput kept)
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 100.0


@dataclass(frozen=True)
class Planned:
    """One request: when it leaves (s from the start), which prompt, how many tokens, and when
    the client cancels it (None: never; 0: `cancel_delay_s` after sending, whatever arrived by
    then; k: once k tokens arrived)."""

    arrival_s: float
    prompt: int
    max_tokens: int
    cancel_after: int | None = None
    cancel_delay_s: float = 0.0


@dataclass
class Outcome:
    kind: str = "lost"  # exact, wrong, failed, lost, cancelled
    request_id: str = ""
    tokens: list[int] = field(default_factory=list)
    sent_s: float = float("nan")
    first_s: float = float("nan")
    last_s: float = float("nan")
    end_s: float = float("nan")
    status: str = ""
    message: str = ""


def plan(spec: ChaosSpec) -> list[Planned]:
    """Poisson arrivals over `duration_s`; a seeded choice of prompt, length and cancellation."""
    rng = random.Random(spec.seed)
    arrivals, t = [], rng.expovariate(spec.rate)
    while t < spec.duration_s:
        arrivals.append(t)
        t += rng.expovariate(spec.rate)
    n = len(arrivals)
    if spec.cancellations is not None:
        if spec.cancellations > n:
            raise SystemExit(
                f"--cancellations {spec.cancellations} > {n} requests: raise --rate or --duration-s"
            )
        cancelled = set(rng.sample(range(n), spec.cancellations))
    else:
        cancelled = {i for i in range(n) if rng.random() < spec.cancel_fraction}
    out = []
    for i, t in enumerate(arrivals):
        prompt, max_tokens = rng.randrange(len(PROMPTS)), rng.choice(MAX_TOKENS)
        cancel_after, delay = None, 0.0
        if i in cancelled:
            if rng.random() < 1 / 3:
                cancel_after, delay = 0, rng.uniform(0, CANCEL_WITHIN_S)
            else:
                cancel_after = rng.randint(1, max_tokens - 1)
        out.append(Planned(t, prompt, max_tokens, cancel_after, delay))
    return out


def references(model: Path) -> list[list[int]]:
    """Each prompt's greedy tokens from the in-process engine (a shorter request's are a
    prefix: greedy with ignore_eos)."""
    engine = LLMEngine(model, EngineConfig(num_blocks=256))
    params = SamplingParams(max_tokens=max(MAX_TOKENS), temperature=0.0, ignore_eos=True)
    return [list(c.token_ids) for c in engine.generate(list(PROMPTS), params)]


async def request(stub, p: Planned, ref: list[int], t0: float, bound_s: float) -> Outcome:
    """Send one planned request at its time, stream it, cancel it as planned, classify it."""
    await asyncio.sleep(max(0.0, t0 + p.arrival_s - time.monotonic()))
    out = Outcome(sent_s=time.monotonic() - t0)
    sampling = common_pb2.SamplingParams(max_tokens=p.max_tokens, ignore_eos=True)
    call = stub.Generate(
        gateway_pb2.GenerateRequest(text=PROMPTS[p.prompt], sampling=sampling), timeout=bound_s
    )
    finish = 0
    cancel_at = time.monotonic() + p.cancel_delay_s if p.cancel_after == 0 else None
    try:
        while True:
            read = call.read()
            if cancel_at is not None:
                try:
                    msg = await asyncio.wait_for(read, max(0.0, cancel_at - time.monotonic()))
                except TimeoutError:
                    call.cancel()
                    ok = out.tokens == ref[: len(out.tokens)]
                    out.kind = "cancelled" if ok else "wrong"
                    return out
            else:
                msg = await read
            if msg is grpc.aio.EOF:
                break
            now = time.monotonic() - t0
            out.request_id = out.request_id or msg.request_id
            if msg.token_ids:
                if not out.tokens:
                    out.first_s = now
                out.tokens += msg.token_ids
                out.last_s = now
            finish = finish or msg.finish_reason
            if p.cancel_after and len(out.tokens) >= p.cancel_after and not finish:
                call.cancel()
                out.kind = "wrong" if out.tokens != ref[: len(out.tokens)] else "cancelled"
                return out
    except grpc.aio.AioRpcError as e:
        out.status, out.message = e.code().name, e.details() or ""
        clear = out.status not in LOST_STATUSES and out.message.strip()
        out.kind = "failed" if clear else "lost"
        return out
    finally:
        out.end_s = time.monotonic() - t0
    if not finish:
        out.kind, out.message = "lost", "the stream ended without a finish reason"
    else:
        out.kind = "exact" if out.tokens == ref[: p.max_tokens] else "wrong"
    return out
