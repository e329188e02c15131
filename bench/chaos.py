"""Chaos: steady load while workers die, drain, come back, and KV transfers fail.

Two meshes of the same shape (default 2 prefill + 2 decode on the embedded `tiny` preset:
`services.engine.presets.default_model("tiny")`, 2 layers, hidden 64, so that a 2-core host
runs the whole mesh, the load and the checks; the model's size is not what this measures) take
the same seeded open-loop Poisson load over gRPC through the gateway, greedy with `ignore_eos`:

1. fault-free (the baseline for goodput);
2. chaos: at seeded random times (exponential gaps, mean `--fault-interval-s`) a worker of a
   role that has another live instance gets SIGKILL or SIGTERM, and is started again
   (`Mesh.restart`) `--restart-delay-s` after it exited; a role is never left empty; a busy
   instance is preferred. The first fault (at `--fault-interval-s`, or a quarter into a shorter
   run) is always a SIGKILL of a decode instance running two streams or more, so that every
   run moves requests. One prefill instance (`prefill-1`) runs with `--kv-faults`: every
   `--transfer-fault-every`-th KV chunk it serves is dropped, corrupted, delayed or its endpoint
   closed (in turn; again from the start after each restart). Midway, a burst of malformed HTTP
   bodies goes to the gateway's HTTP port.

In both runs a share of the requests (`--cancellations N` exactly, else `--cancel-fraction`) is
cancelled by the client at a random point: a third at a random time 0-50 ms after sending
(mostly before the first token: in the prefill queue, in prefill, or during the KV pull), the
rest once k tokens arrived (k uniform in [1, max_tokens - 1]).

Every request is accounted for: completed with exactly the in-process engine's tokens; completed
with other tokens (wrong, must be 0; a cancelled request's tokens must be a prefix); failed with
a clear error (a status other than UNKNOWN / INTERNAL / DEADLINE_EXCEEDED and a message); lost
(no answer within `--bound-s`, UNKNOWN or INTERNAL, an empty message, or a stream that ended
without a finish reason; must be 0).

`migrated_ok_fraction`: of the requests hit by the loss of their decode instance, the fraction
that ended right: completed with exact tokens, or, for one the client cancelled, with tokens
that are a prefix of the reference. A request counts as hit when the gateway logged moving it
("lost its serving instance"; its stderr goes to a log file, matched on the request id the
responses carry), or when it had tokens, was in flight at a decode fault and then failed: a
gateway that did not migrate would fail those requests and the fraction would fall below 1.
Client-cancelled requests count too: a moved stream is as likely to be one of them as not, and
leaving them out made a run whose moved streams were all cancelled ones show no migration. The
gateway's `distserve_migrations_total` delta is reported beside it.

`leaked_blocks` (both meshes, summed): once the load stopped, every worker is back and a lease
has had time to lapse, the KV blocks in use plus the KV handles held on live workers, plus the
blocks freed by lapsed leases during the run (prefill `Stats` are polled every second and just
before a prefill instance is signalled; a prefill lease is `--lease-s`, short, so that a leak
shows within the run).

Goodput kept: requests completed exactly within both SLOs (`--slo-ttft-ms`, `--slo-tpot-ms`,
the gateway's defaults 1000 / 100 ms), cancelled requests left out, with faults over without
(`--no-baseline` skips the fault-free run: the short test in `make test` does).

Prints a table, the hardware and the model, and last one JSON line.

    .venv/bin/python bench/chaos.py [--duration-s 300] [--rate 6] [--seed 0]
        [--cancellations 1000] [--out chaos.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import signal
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import grpc
import numpy as np
import torch

from services.common import mesh_tls
from services.common.gen.distserve.v1 import (
    common_pb2,
    decode_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    prefill_pb2_grpc,
)
from services.common.sampling import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.presets import default_model
from services.launcher import Mesh, MeshSpec

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
WORKER_ARGS = ("--kv-cache-mb", "16", "--max-num-seqs", "16")
# A dead KV source is given up on fast: short chunk tries (a dropped chunk costs 1 s).
DECODE_ARGS = ("--chunk-timeout-s", "1", "--chunk-attempts", "3")
TRANSFER_FAULTS = ("drop", "corrupt", "delay", "close")
FAULTED_PREFILL = "prefill-1"
CANCEL_WITHIN_S = 0.05  # an early cancel comes 0-50 ms after sending
MOVED = re.compile(r"request (\S+): lost its serving instance")
LOST_STATUSES = ("UNKNOWN", "INTERNAL", "DEADLINE_EXCEEDED")


@dataclass(frozen=True)
class ChaosSpec:
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


# --- the client -------------------------------------------------------------------------------


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


# --- the mesh and its workers ---------------------------------------------------------------


def mesh_spec(model: Path, spec: ChaosSpec, logs: Path, transfer_faults: bool) -> MeshSpec:
    names = ["gateway"] + [f"prefill-{i}" for i in range(spec.prefill)]
    names += [f"decode-{i}" for i in range(spec.decode)]
    per_worker = {}
    if transfer_faults:
        per_worker[FAULTED_PREFILL] = ("--kv-faults", fault_spec(spec.transfer_fault_every))
    return MeshSpec(
        model=model,
        prefill=spec.prefill,
        decode=spec.decode,
        gateway_port=0,
        worker_args=WORKER_ARGS,
        prefill_args=("--lease-s", str(spec.lease_s)),
        decode_args=DECODE_ARGS,
        per_worker_args=per_worker,
        drain_timeout_s=spec.drain_timeout_s,
        # Each process's log (stderr) to its own file: the gateway's says which request moved.
        command_prefix={
            n: ("sh", "-c", 'exec "$@" 2>>"$0"', str(logs / f"{n}.log")) for n in names
        },
    )


def fault_spec(every: int, last_chunk: int = 20_000) -> str:
    """`--kv-faults`: every `every`-th chunk hit by the next of TRANSFER_FAULTS, in turn."""
    faults = []
    for i, at in enumerate(range(every, last_chunk, every)):
        kind = TRANSFER_FAULTS[i % len(TRANSFER_FAULTS)]
        faults.append(f"delay@{at}:0.3" if kind == "delay" else f"{kind}@{at}")
    return ",".join(faults)


async def stats(address: str, role: str) -> common_pb2.WorkerStats:
    async with mesh_tls.aio_channel(address) as channel:
        stub_type = (
            prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub
        )
        return await stub_type(channel).Stats(common_pb2.StatsRequest(), timeout=5)


def role_of(name: str) -> str:
    return name.split("-")[0]


def live(mesh: Mesh) -> list:
    return [p for p in mesh.workers if p.popen.poll() is None and p.ready is not None]


# Worker counters summed over every incarnation of every worker (a restarted one counts anew).
COUNTERS = (
    "leases_expired",
    "blocks_reclaimed",
    "requests_aborted",
    "pulls_failed",
    "chunks_retried",
    "checksum_failures",
    "reconnects",
)


class Ledger:
    """Worker counters per incarnation (name, pid): the highest value each reported. Polled
    every second and just before a worker is signalled (a dead worker's counters are gone)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[str, int], dict[str, int]] = {}

    async def poll(self, proc) -> common_pb2.WorkerStats | None:
        try:
            s = await stats(proc.ready["address"], role_of(proc.name))
        except grpc.aio.AioRpcError:
            return None  # dying or draining: its last poll stands
        old = self.seen.setdefault((proc.name, proc.popen.pid), dict.fromkeys(COUNTERS, 0))
        for k in COUNTERS:
            old[k] = max(old[k], getattr(s, k))
        return s

    async def watch(self, mesh: Mesh, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.gather(*(self.poll(p) for p in live(mesh)))
            await asyncio.sleep(1.0)

    def totals(self) -> dict[str, int]:
        return {k: sum(v[k] for v in self.seen.values()) for k in COUNTERS}


def busy(role: str, s: common_pb2.WorkerStats | None, streams: int = 1) -> bool:
    """Decode: `streams` or more running; prefill: prompts queued or KV held for a pull."""
    if s is None:
        return False
    if role == "decode":
        return s.load.running_seqs >= streams
    return bool(s.load.queued_prompt_tokens or s.load.held_kv_handles)


class Chaos:
    """Signals random workers at random times, restarts them; never leaves a role empty."""

    def __init__(self, mesh: Mesh, spec: ChaosSpec, ledger: Ledger, t0: float) -> None:
        self.mesh, self.spec, self.ledger, self.t0 = mesh, spec, ledger, t0
        self.rng = random.Random(spec.seed + 1)
        self.down: set[str] = set()
        self.events: list[dict] = []
        self.restarts: list[asyncio.Task] = []

    async def run(self, until_s: float) -> None:
        # The first fault early (a quarter into a short run), then at random.
        first_s = min(until_s / 4, self.spec.fault_interval_s)
        await asyncio.sleep(max(0.0, self.t0 + first_s - time.monotonic()))
        while True:
            if self.events:
                await asyncio.sleep(self.rng.expovariate(1 / self.spec.fault_interval_s))
            if time.monotonic() - self.t0 >= until_s:
                break
            first = not self.events
            role = "decode" if first else self.rng.choice(("prefill", "decode"))
            sig = signal.SIGKILL
            if not first and self.rng.random() >= self.spec.sigkill_fraction:
                sig = signal.SIGTERM
            # The first waits (up to 10 s) for two streams on one instance, so that it most
            # likely cuts off a request the client does not cancel itself.
            await self.fault(
                role, sig, wait_busy_s=10.0 if first else 1.0, streams=2 if first else 1
            )
        await asyncio.gather(*self.restarts)

    async def fault(
        self, role: str, sig: signal.Signals, wait_busy_s: float, streams: int = 1
    ) -> None:
        up = [p for p in live(self.mesh) if role_of(p.name) == role and p.name not in self.down]
        if len(up) < 2:
            return  # the role would be left empty
        deadline = time.monotonic() + wait_busy_s
        while True:  # prefer an instance with work in flight
            polls = await asyncio.gather(*(self.ledger.poll(p) for p in up))
            hot = [p for p, s in zip(up, polls, strict=True) if busy(role, s, streams)]
            if hot or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        victim = self.rng.choice(hot or up)
        self.down.add(victim.name)
        victim.popen.send_signal(sig)
        self.events.append(
            {
                "t_s": round(time.monotonic() - self.t0, 3),
                "worker": victim.name,
                "signal": sig.name,
                "busy": bool(hot),
            }
        )
        self.restarts.append(asyncio.create_task(self.restart(victim)))

    async def restart(self, proc) -> None:
        await asyncio.to_thread(proc.popen.wait, self.spec.drain_timeout_s + 30)
        await asyncio.sleep(self.spec.restart_delay_s)
        await asyncio.to_thread(self.mesh.restart, proc.name)
        self.down.discard(proc.name)


# --- malformed HTTP bodies ------------------------------------------------------------------


def malformed_bodies(rng: random.Random, n: int) -> list[bytes]:
    """`n` request bodies the API must refuse with a 4xx (or, at worst, serve): not JSON, not
    an object, wrong types, values past every limit, hostile strings, deep nesting."""
    makers = [
        lambda: rng.randbytes(rng.randint(1, 64)),
        lambda: b'{"prompt": "Hello", "max_tokens": 4'[: rng.randint(1, 34)],
        lambda: rng.choice([b"[]", b'"prompt"', b"1", b"null", b"", b"{}"]),
        lambda: b'{"prompt": ' + rng.choice([b"5", b"null", b"[[1]]", b"{}", b"true"]) + b"}",
        lambda: (
            b'{"prompt": "x", "max_tokens": '
            + rng.choice([b"-1", b"0", b'"many"', b"1e400", b"1" + b"0" * 40, b"NaN", b"4.5"])
            + b"}"
        ),
        lambda: (
            b'{"prompt": "x", "max_tokens": 4, "temperature": '
            + rng.choice([b"-1", b"NaN", b"Infinity", b'"hot"', b"1e309"])
            + b"}"
        ),
        lambda: b'{"prompt": "\\ud800\\udfff\\ud800", "max_tokens": 4, "stop": {"a": 1}}',
        lambda: b'{"prompt": "\xff\xfe\xfd", "max_tokens": 4}',
        lambda: b"[" * rng.randint(1_000, 100_000),
        lambda: b'{"prompt": "x", "max_tokens": 4, "stop_token_ids": [-5, 99999999999]}',
        lambda: b'{"prompt": [1, -2, 1e99], "max_tokens": 4}',
        lambda: b'{"messages": [{"role": "wizard", "content": 7}], "max_tokens": 4}',
    ]
    return [rng.choice(makers)() for _ in range(n)]


async def fuzz_burst(http_address: str, bodies: list[bytes]) -> dict:
    """POST each body to the completions endpoints; count 5xx answers and no answers."""
    out = {"sent": len(bodies), "5xx": 0, "no_answer": 0, "statuses": {}}
    timeout = aiohttp.ClientTimeout(total=20)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for i, body in enumerate(bodies):
            path = "/v1/chat/completions" if i % 2 else "/v1/completions"
            headers = {"Content-Type": "application/json"}
            try:
                async with session.post(
                    f"http://{http_address}{path}", data=body, headers=headers
                ) as r:
                    await r.read()
                    out["statuses"][str(r.status)] = out["statuses"].get(str(r.status), 0) + 1
                    out["5xx"] += r.status >= 500
            except (aiohttp.ClientError, TimeoutError):
                out["no_answer"] += 1
    return out


# --- one run --------------------------------------------------------------------------------


def migrations(mesh: Mesh) -> dict[str, float]:
    """The gateway's `distserve_migrations_total`, by reason."""
    host = next(p for p in mesh.processes if p.name == "gateway").ready["metrics_address"]
    with urllib.request.urlopen(f"http://{host}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("distserve_migrations_total{"):
            reason = re.search(r'reason="([^"]*)"', line)
            out[reason.group(1) if reason else ""] = float(line.split()[-1])
    return out


async def settle(mesh: Mesh, spec: ChaosSpec, ledger: Ledger) -> dict:
    """Once the load stopped: wait for a lease to lapse, then for the KV to be free (at most
    10 s more); what is still held, and what lapsed during the run."""
    await asyncio.sleep(spec.lease_s + 1.0)
    deadline = time.monotonic() + 10.0
    while True:
        polls = await asyncio.gather(*(ledger.poll(p) for p in live(mesh)))
        loads = [s.load for s in polls if s is not None]
        in_use = sum(x.total_kv_blocks - x.free_kv_blocks for x in loads)
        held = sum(x.held_kv_handles for x in loads)
        if (in_use == 0 and held == 0) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    counters = ledger.totals()
    return {
        "live_workers": len(loads),
        "blocks_in_use": in_use,
        "held_handles": held,
        "leases_lapsed": counters["leases_expired"],
        "blocks_lapsed": counters["blocks_reclaimed"],
        "leaked_blocks": in_use + held + counters["blocks_reclaimed"],
        "counters": counters,
    }


async def run_phase(
    mesh: Mesh, spec: ChaosSpec, planned: list[Planned], refs: list[list[int]], chaos: bool
) -> dict:
    ledger, stop = Ledger(), asyncio.Event()
    t0 = time.monotonic() + 0.5
    before = migrations(mesh)
    watch = asyncio.create_task(ledger.watch(mesh, stop))
    driver = Chaos(mesh, spec, ledger, t0)
    side = []
    if chaos:
        side.append(asyncio.create_task(driver.run(spec.duration_s)))
        bodies = malformed_bodies(random.Random(spec.seed + 2), spec.fuzz_bodies)

        async def burst() -> dict:
            await asyncio.sleep(max(0.0, t0 + spec.duration_s / 2 - time.monotonic()))
            return await fuzz_burst(mesh.gateway_http_address, bodies)

        side.append(asyncio.create_task(burst()))
    async with mesh_tls.aio_channel(mesh.gateway_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        outcomes = await asyncio.gather(
            *(request(stub, p, refs[p.prompt], t0, spec.bound_s) for p in planned)
        )
    side_results = await asyncio.gather(*side)
    print(f"chaos: load done in {time.monotonic() - t0:.1f} s; settling", flush=True)
    leaks = await settle(mesh, spec, ledger)
    stop.set()
    await watch
    after = migrations(mesh)
    return {
        "outcomes": outcomes,
        "events": driver.events,
        "fuzz": side_results[1] if chaos else None,
        "leaks": leaks,
        "migrations": {k: after[k] - before.get(k, 0.0) for k in after},
    }


def phase(model: Path, spec: ChaosSpec, planned, refs, chaos: bool, logs: Path) -> dict:
    logs.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    with Mesh(mesh_spec(model, spec, logs, transfer_faults=chaos)) as mesh:
        started = time.monotonic() - t
        result = asyncio.run(run_phase(mesh, spec, planned, refs, chaos))
    result["mesh_start_s"] = round(started, 1)
    name = "chaos" if chaos else "fault-free"
    print(f"chaos: {name} run: mesh up in {started:.1f} s, {time.monotonic() - t:.1f} s in all")
    result["moved_ids"] = set(MOVED.findall((logs / "gateway.log").read_text(errors="replace")))
    return result


# --- figures --------------------------------------------------------------------------------


def figures(spec: ChaosSpec, planned: list[Planned], result: dict) -> dict:
    outcomes: list[Outcome] = result["outcomes"]
    kinds = {k: 0 for k in ("exact", "wrong", "failed", "lost", "cancelled")}
    for o in outcomes:
        kinds[o.kind] += 1
    served = [(p, o) for p, o in zip(planned, outcomes, strict=True) if p.cancel_after is None]
    met, ttft, tpot = 0, [], []
    for _, o in served:
        if o.kind != "exact":
            continue
        t1 = o.first_s - o.sent_s
        t2 = (o.last_s - o.first_s) / (len(o.tokens) - 1) if len(o.tokens) > 1 else 0.0
        ttft.append(t1)
        tpot.append(t2)
        met += t1 * 1000 <= spec.slo_ttft_ms and t2 * 1000 <= spec.slo_tpot_ms
    return {
        **kinds,
        "requests": len(outcomes),
        "client_cancellations": sum(p.cancel_after is not None for p in planned),
        "slo_met": met,
        "goodput_rps": round(met / spec.duration_s, 3),
        "ttft_ms": _pct(ttft),
        "tpot_ms": _pct(tpot),
        "failures": _failures(outcomes),
    }


def hit_by_decode_loss(result: dict) -> list[int]:
    """Requests the gateway moved off a lost decode instance, and requests in flight with
    tokens at a decode fault that then failed (what a gateway that does not migrate does)."""
    faults = [e["t_s"] for e in result["events"] if e["worker"].startswith("decode")]
    hit = []
    for i, o in enumerate(result["outcomes"]):
        moved = o.request_id and o.request_id in result["moved_ids"]
        cut = o.kind in ("failed", "lost") and any(o.first_s <= t <= o.end_s for t in faults)
        if moved or cut:
            hit.append(i)
    return hit


def _pct(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None}
    return {f"p{q}": round(float(np.percentile(values, q)) * 1000, 1) for q in (50, 99)}


def _failures(outcomes: list[Outcome]) -> dict:
    out: dict[str, int] = {}
    for o in outcomes:
        if o.kind in ("failed", "lost"):
            key = f"{o.kind} {o.status}: {o.message[:100]}"
            out[key] = out.get(key, 0) + 1
    return out


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} x {cpu}, torch {torch.__version__}"


def table(base: dict, chaos: dict) -> str:
    rows = [
        ("requests", "requests"),
        ("completed, exact tokens", "exact"),
        ("completed, wrong tokens", "wrong"),
        ("failed, clear error", "failed"),
        ("lost", "lost"),
        ("cancelled by the client", "cancelled"),
        ("exact within both SLOs", "slo_met"),
        ("goodput (req/s)", "goodput_rps"),
    ]
    cells = [(label, base[key], chaos[key]) for label, key in rows]
    for key in ("ttft_ms", "tpot_ms"):
        for q in ("p50", "p99"):
            b = base[key][q] if base[key] is not None else None
            cells.append((f"{key[:4].upper()} {q} (ms, exact)", b, chaos[key][q]))
    lines = [
        f"| {'':<26} | {'fault-free':>10} | {'chaos':>10} |",
        f"|{'-' * 28}|{'-' * 12}:|{'-' * 11}:|",
    ]
    lines += [f"| {label:<26} | {_cell(b):>10} | {_cell(c):>10} |" for label, b, c in cells]
    return "\n".join(lines)


def _cell(x) -> str:
    return "-" if x is None else str(x)


def main(argv: list[str] | None = None) -> int:
    d = ChaosSpec()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration-s", type=float, default=d.duration_s, help="load per run")
    p.add_argument("--rate", type=float, default=d.rate, help="Poisson arrivals, req/s")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--cancellations", type=int, default=d.cancellations, help="exactly N per run")
    p.add_argument("--cancel-fraction", type=float, default=d.cancel_fraction, help="without N")
    p.add_argument("--prefill", type=int, default=d.prefill)
    p.add_argument("--decode", type=int, default=d.decode)
    p.add_argument("--fault-interval-s", type=float, default=d.fault_interval_s)
    p.add_argument("--restart-delay-s", type=float, default=d.restart_delay_s)
    p.add_argument("--sigkill-fraction", type=float, default=d.sigkill_fraction)
    p.add_argument("--drain-timeout-s", type=float, default=d.drain_timeout_s)
    p.add_argument("--lease-s", type=float, default=d.lease_s, help="prefill KV lease")
    p.add_argument("--transfer-fault-every", type=int, default=d.transfer_fault_every)
    p.add_argument("--fuzz-bodies", type=int, default=d.fuzz_bodies)
    p.add_argument("--bound-s", type=float, default=d.bound_s, help="a slower request is lost")
    p.add_argument("--slo-ttft-ms", type=float, default=d.slo_ttft_ms)
    p.add_argument("--slo-tpot-ms", type=float, default=d.slo_tpot_ms)
    p.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=d.baseline,
        help="the fault-free run first (goodput kept); --no-baseline: the chaos run only",
    )
    p.add_argument("--logs", type=Path, help="the processes' logs (default: a new temp folder)")
    p.add_argument("--out", type=Path, help="write the JSON summary (and fault events) here")
    a = p.parse_args(argv)
    if a.cancellations is not None and a.cancellations < 0:
        a.cancellations = None
    if min(a.prefill, a.decode) < 2:
        p.error("chaos needs 2+ instances of each role (a role is never left empty)")
    spec = ChaosSpec(**{k: getattr(a, k) for k in ChaosSpec.__dataclass_fields__})
    start = time.monotonic()
    model = default_model("tiny")
    torch.set_num_threads(1)  # the references; the cores are the mesh's
    planned = plan(spec)
    refs = references(model)
    logs = a.logs or Path(tempfile.mkdtemp(prefix="distserve-chaos-"))
    base = None
    if spec.baseline:
        base = phase(model, spec, planned, refs, chaos=False, logs=logs / "fault-free")
    chaos = phase(model, spec, planned, refs, chaos=True, logs=logs / "chaos")
    fc = figures(spec, planned, chaos)
    fb = figures(spec, planned, base) if base is not None else {k: None for k in fc}
    base_leaks = base["leaks"] if base is not None else {"leaked_blocks": 0}
    hit = hit_by_decode_loss(chaos)
    hit_ok = sum(chaos["outcomes"][i].kind in ("exact", "cancelled") for i in hit)
    events = chaos["events"]
    summary = {
        "bench": "chaos",
        "model": "tiny",
        "hardware": hardware(),
        "mesh": f"{spec.prefill}P{spec.decode}D",
        "spec": asdict(spec),
        "lost_requests": (fb["lost"] or 0) + fc["lost"],
        "wrong_tokens": (fb["wrong"] or 0) + fc["wrong"],
        "failed_clear": fc["failed"],
        "completed_exact": fc["exact"],
        "cancelled": fc["cancelled"],
        "client_cancellations": fc["client_cancellations"],
        "leaked_blocks": base_leaks["leaked_blocks"] + chaos["leaks"]["leaked_blocks"],
        "leaks": {"fault-free": base_leaks, "chaos": chaos["leaks"]},
        "migrated_requests": len(hit),
        "migrated_ok_fraction": round(hit_ok / len(hit), 4) if hit else None,
        "migrations_metric": chaos["migrations"],
        "fuzz_5xx": chaos["fuzz"]["5xx"],
        "fuzz_no_answer": chaos["fuzz"]["no_answer"],
        "fuzz": chaos["fuzz"],
        "faults": {
            "sigkill": sum(e["signal"] == "SIGKILL" for e in events),
            "sigterm": sum(e["signal"] == "SIGTERM" for e in events),
            "decode": sum(e["worker"].startswith("decode") for e in events),
            "prefill": sum(e["worker"].startswith("prefill") for e in events),
            "transfer_faults_on": FAULTED_PREFILL,
            "transfer_fault_every": spec.transfer_fault_every,
            **{k: chaos["leaks"]["counters"][k] for k in COUNTERS[3:]},
        },
        "goodput_kept": round(fc["slo_met"] / fb["slo_met"], 4) if fb["slo_met"] else None,
        "cancelled_before_first_token": sum(
            o.kind == "cancelled" and not o.tokens for o in chaos["outcomes"]
        ),
        "fault_free": fb,
        "chaos": fc,
        "logs": str(logs),
        "seconds": round(time.monotonic() - start, 1),
    }
    print(f"\nChaos: tiny model, {spec.prefill}P{spec.decode}D, {hardware()}")
    print(
        f"{len(planned)} requests at {spec.rate} req/s over {spec.duration_s} s, seed {spec.seed}"
    )
    print(table(fb, fc))
    print(f"faults: {json.dumps(summary['faults'])}; events: {len(events)}")
    print(f"migrations (metric delta): {json.dumps(chaos['migrations'])}")
    if a.out is not None:
        failed = [
            {"i": i, **asdict(p), **asdict(o), "tokens": len(o.tokens)}
            for i, (p, o) in enumerate(zip(planned, chaos["outcomes"], strict=True))
            if o.kind in ("failed", "lost", "wrong")
        ]
        detail = {"events": events, "failed_requests": failed}
        a.out.write_text(json.dumps({**summary, **detail}, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
