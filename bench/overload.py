"""Overload: at 5x the goodput rate, do accepted requests still meet the SLO, and does every
process's resident memory stay within a documented bound?

Target: "under 5x the goodput rate, accepted requests still meet the SLO at >= 90% attainment and
each process's resident memory stays within a documented bound."

What runs, in one invocation (every mesh: 1 prefill + 1 decode, `services.launcher.Mesh`, built by
`services.loadgen.cli.mesh_spec` exactly as `distserve bench goodput` builds its disaggregated
mode: each worker pinned to its own core with one torch thread, engine options
`services.loadgen.cli.WORKER_ARGS` = `--kv-cache-mb 384 --max-num-seqs 16 --max-batch-tokens
2048`; no Envoy; the load goes over gRPC straight to the gateway):

1. **Goodput.** A first mesh, admission off (so that a refusal never counts as a miss and the
   rate found is what the mesh serves), gets the SLO by `distserve bench goodput`'s rule
   (`services.loadgen.goodput.unloaded` + `slo_from_unloaded`: 5x the unloaded TTFT, 3x the
   unloaded TPOT of the workload's median request) and its goodput by `search_goodput` (alpha
   0.9, Poisson, `--requests-per-probe` seeded requests per probe, at most `--max-probes`
   probes, the first bracket from `rate_range`). `--slo` and `--goodput-rps` skip these.
2. **Overload, twice, each on a fresh mesh** (no shared queues, a clean idle reading): the same
   workload at `--factor` (5) x the goodput rate, open loop, Poisson, for `--duration-s`:
   (a) **admission on**: the gateway's admission defaults (`--max-inflight 1024`,
   `--admission-ttft-factor 1`, `--decode-pull-watermark 16`, `--decode-kv-watermark 0.95`,
   `--decode-tpot-watermark 1`; docs/deployment.md, "Admission"), with the gateway told the SLO
   being measured (`--slo-ttft-ms`, `--slo-tpot-ms`: the rules judge against it);
   (b) **baseline, admission off**:
   `--admission-ttft-factor 0` (which also switches the decode watermarks off: they are only
   checked with the TTFT rule; they are set to never trigger besides), `--max-inflight 1000000`.
   Each request is accounted for: accepted (answered with tokens), refused with
   RESOURCE_EXHAUSTED (and whether the gRPC trailing metadata `retry-after-ms` came with it), or
   failed otherwise (listed by status and message; must be 0 with admission on). Among the
   accepted: joint SLO attainment, TTFT and TPOT p50/p90/p99; goodput achieved = accepted
   requests meeting both SLOs per second (first send to last reply, the load generator's
   `duration_s`). Refusals by rule come from the gateway's `distserve_admission_refusals_total`.
   Each request times out after `--request-timeout-s` (120 s, the load generator's default):
   in the baseline a request still queued then counts as failed (DEADLINE_EXCEEDED).
3. **Memory.** VmRSS (/proc/PID/status) of every process of the mesh (the gateway, each worker,
   and any of their descendants) every `--sample-s` (0.5 s) during each run; an idle reading
   before load (median of 4 samples over 2 s, after the warm-up below, so that one-time
   allocations on first use are in it; the reading straight after start is printed too); per
   process: idle, peak, peak - idle, and the bound.

Warm-up of each overload mesh: 3 sequential requests of the workload's median size, then 8
sequential 2-token requests with prompts from 64 to 512 tokens. The gateway predicts TTFT from a
line fitted to the prefill batches it has seen, and predicts nothing (so refuses nothing on that
rule) until 8 batches span a factor of two in size; the varied warm-up stands for a mesh that
served traffic before the overload came. `--cold-start` leaves it out: the overload then hits a
mesh whose predictor has no fit yet, as right after start.

**The bound** (`allowance()`; idle + allowance; it follows what bounds memory in the code, the
constants are stated, not fitted):

* Every request the mesh holds state for was admitted by the gateway, which holds at most
  `--max-inflight` (M = 1024) at once; each is at most the model's context C (4096 tokens,
  prompt + output) long. With admission off there is no M: no bound exists, and the baseline
  shows what that costs.
* A worker's KV pool (`--kv-cache-mb`) is zero-filled when the engine starts
  (`services.engine.kv_cache.KvCache`: `torch.zeros`), so it is resident at idle already, as are
  the weights: no KV term. On top of idle a worker may hold: the activations of its largest
  step (prefill: one batch of `--max-batch-tokens` T tokens, T x (4 hidden + 3 intermediate +
  vocab) x 4 B, plus attention scores heads x T^2 x 4 B as if materialised for one prompt of T
  tokens; decode: `--max-num-seqs` S sequences, S x (4 hidden + 3 intermediate + vocab) x 4 B
  plus S x heads x C x 4 B of scores); KV chunks in flight, S pulls x the puller's window
  (4) x its chunk size (4 MiB) (a decode instance pulls for at most its free seats; zero when the
  transport writes in place); the state of M queued requests, M x (C x 36 B (a token id in a
  Python list: an 8-byte slot and a 28-byte int) + 64 KiB (a gRPC stream's receive window and
  call objects)); and 64 MiB for allocator slack, thread stacks and metrics.
* The gateway: M x (C x 80 B (the ids in two Python lists and protobuf copies) + 3 x 64 KiB (the
  client's stream and the calls to prefill and decode)) + 64 MiB.

Model and sizes: the `small` preset (12 layers, hidden 768, GQA 12/4, 105M parameters, fp32),
as `distserve bench goodput` uses, because `tiny` serves the chat workload in a few ms per
request, so that 5x its goodput would be hundreds of requests per second and the load generator
on these 2 cores would be the bottleneck, not the mesh; with `small` the prefill core saturates
at under 2 req/s, and a 1.2 GB worker makes the memory figures those of a real model.
Workload: the CPU-scaled `chat` (`services.loadgen.goodput.SCALED`: prompts lognormal 256 +- 200
tokens [16, 768], outputs 48 +- 40 [4, 128]), `--workload` takes another. Defaults are sized for
about 10-15 minutes on 2 shared cores: 24 requests per probe and at most 5 probes for the search
(as bench/goodput.py), 90 s of overload per run (the baseline then runs until its backlog is
served or times out). The gateway, the load generator and this process's sampler share the cores
with the pinned workers.

Prints the search, a table of both runs, the memory table with the bound, the hardware and model,
and last one JSON line `{"bench": "overload", ...}`.

    .venv/bin/python bench/overload.py [--duration-s 90] [--factor 5] [--workload chat]
        [--requests-per-probe 24] [--max-probes 5] [--goodput-rps R] [--slo TTFT_MS,TPOT_MS]
        [--admission-ttft-factor F] [--cold-start] [--out overload.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from collections import Counter
from importlib import metadata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc
import numpy as np

from services.common.model_config import ModelConfig
from services.engine.presets import default_model
from services.gateway.admission import AdmissionConfig
from services.kvtransfer.puller import PullPolicy
from services.launcher import Mesh, MeshSpec
from services.loadgen import goodput as g
from services.loadgen.cli import ADMISSION_OFF, WORKER_ARGS, BenchSpec, mesh_spec
from services.loadgen.requests import load_requests
from services.loadgen.results import LoadResult
from services.loadgen.runner import run_load
from services.loadgen.targets import GrpcTarget, LoadError
from services.planner.simulator import Slo
from services.planner.workload import Requests

MiB = 2**20
# The bound's stated constants (see the module docstring).
PY_TOKEN_BYTES = 36  # a token id in a Python list: 8 B slot + 28 B int object
GATEWAY_TOKEN_BYTES = 80  # two Python lists and protobuf copies of each id
CALL_BYTES = 64 * 2**10  # one gRPC stream: its receive window and call objects
FIXED_BYTES = 64 * MiB  # allocator slack, thread stacks, metrics
FLOAT_BYTES = 4  # fp32 activations


# -- load ---------------------------------------------------------------------------------------


class HintedGrpcTarget(GrpcTarget):
    """The load generator's gRPC target, also keeping each refusal's `retry-after-ms` trailing
    metadata (by request object id): `LoadError` carries only the status and the message."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.retry_after_ms: dict[int, int] = {}

    async def stream(self, request, timeout_s):
        try:
            async for chunk in super().stream(request, timeout_s):
                yield chunk
        except LoadError as e:
            rpc = e.__context__  # GrpcTarget raises LoadError from the AioRpcError it caught
            if isinstance(rpc, grpc.aio.AioRpcError):
                for key, value in rpc.trailing_metadata() or ():
                    if key == "retry-after-ms":
                        self.retry_after_ms[id(request)] = int(value)
            raise


# -- memory -------------------------------------------------------------------------------------


def vm_rss(pid: int) -> int | None:
    """Resident memory of `pid` in bytes (VmRSS), None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return None


def descendants(pid: int) -> list[int]:
    """Every descendant of `pid` (from /proc/PID/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except FileNotFoundError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(x) for x in f.read().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
            out += kids
            todo += kids
    return out


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except FileNotFoundError:
        return "?"


class RssSampler:
    """VmRSS of every process of a mesh (and their descendants), sampled on a thread."""

    def __init__(self, mesh: Mesh, interval_s: float) -> None:
        self.roots = {p.name: p.popen.pid for p in mesh.processes}
        self.interval_s = interval_s
        self.role = {}  # process name -> the role whose bound applies
        self.samples: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> dict[str, int]:
        """One reading: name -> bytes. A descendant is named ROOT/COMM-PID."""
        out = {}
        for name, pid in self.roots.items():
            rss = vm_rss(pid)
            if rss is not None:
                out[name] = rss
                self.role.setdefault(name, role_of(name))
            for child in descendants(pid):
                rss = vm_rss(child)
                if rss is not None:
                    key = f"{name}/{comm(child)}-{child}"
                    out[key] = rss
                    self.role.setdefault(key, role_of(name))
        return out

    def idle(self, n: int = 4) -> dict[str, int]:
        """The median of `n` readings one interval apart."""
        readings = []
        for i in range(n):
            if i:
                time.sleep(self.interval_s)
            readings.append(self.read())
        names = set().union(*readings)
        return {k: int(statistics.median(r[k] for r in readings if k in r)) for k in names}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            for k, v in self.read().items():
                self.samples.setdefault(k, []).append(v)


def role_of(name: str) -> str:
    return "gateway" if name == "gateway" else name.split("-")[0]


def engine_options(args: tuple[str, ...]) -> dict[str, int]:
    """`--kv-cache-mb 384 --max-num-seqs 16 ...` as {"kv_cache_mb": 384, ...}."""
    pairs = zip(args[::2], args[1::2], strict=True)
    return {k.removeprefix("--").replace("-", "_"): int(v) for k, v in pairs}


def allowance(role: str, model: ModelConfig, engine: dict[str, int], max_inflight: int) -> dict:
    """What a process of `role` may hold on top of its idle RSS, term by term (bytes), from the
    mechanisms that bound it; see the module docstring."""
    ctx = model.max_position_embeddings
    if role == "gateway":
        terms = {
            "requests": max_inflight * (ctx * GATEWAY_TOKEN_BYTES + 3 * CALL_BYTES),
            "fixed": FIXED_BYTES,
        }
        formula = (
            f"M x (C x {GATEWAY_TOKEN_BYTES} B + 3 x 64 KiB) + 64 MiB, M={max_inflight}, C={ctx}"
        )
        return {"terms": terms, "total": sum(terms.values()), "formula": formula}
    per_token = (
        4 * model.hidden_size + 3 * model.intermediate_size + model.vocab_size
    ) * FLOAT_BYTES
    seqs, batch = engine["max_num_seqs"], engine["max_batch_tokens"]
    policy = PullPolicy()
    if role == "decode":
        act = seqs * per_token + seqs * model.num_heads * ctx * FLOAT_BYTES
        act_text = "S x (4h + 3i + V) x 4 B + S x heads x C x 4 B"
    else:  # prefill (colocated would need both; this bench runs none)
        act = batch * per_token + model.num_heads * batch * batch * FLOAT_BYTES
        act_text = "T x (4h + 3i + V) x 4 B + heads x T^2 x 4 B"
    terms = {
        "activations": act,
        "kv_in_flight": seqs * policy.window * policy.chunk_bytes,
        "requests": max_inflight * (ctx * PY_TOKEN_BYTES + CALL_BYTES),
        "fixed": FIXED_BYTES,
    }
    formula = (
        f"{act_text} + S x {policy.window} x {policy.chunk_bytes // MiB} MiB + "
        f"M x (C x {PY_TOKEN_BYTES} B + 64 KiB) + 64 MiB, T={batch}, S={seqs}, "
        f"M={max_inflight}, C={ctx}"
    )
    return {"terms": terms, "total": sum(terms.values()), "formula": formula}


# -- one overload run ---------------------------------------------------------------------------


def gateway_refusals(mesh: Mesh) -> dict[str, float]:
    """`distserve_admission_refusals_total` by reason, from the gateway's /metrics."""
    gateway = next(p for p in mesh.processes if p.name == "gateway")
    return {
        s.labels["reason"]: s.value
        for s in gateway.metrics()
        if s.name == "distserve_admission_refusals_total"
    }


def overload_run(
    label: str,
    spec: MeshSpec,
    base,
    requests,
    slo: Slo,
    vocab: int,
    args: argparse.Namespace,
) -> dict:
    """One fresh mesh: warm up, read idle memory, offer `requests`, sample memory throughout."""
    log(f"[{label}] starting the mesh")
    mesh = Mesh(spec)
    mesh.start()
    try:
        sampler = RssSampler(mesh, args.sample_s)
        at_start = sampler.read()
        warm = g.unloaded(GrpcTarget(mesh.gateway_address), base, vocab, repeats=2)
        if not args.cold_start:
            warm_up_sizes(GrpcTarget(mesh.gateway_address), vocab)
        time.sleep(1.0)
        idle = sampler.idle()
        target = HintedGrpcTarget(mesh.gateway_address)
        prompts = load_requests(requests, vocab, args.seed)
        log(
            f"[{label}] offering {len(prompts)} requests over {requests.arrival_s[-1]:.0f} s "
            f"({len(prompts) / requests.arrival_s[-1]:.2f} req/s)"
        )
        sampler.start()
        t0 = time.monotonic()
        try:
            result = asyncio.run(run_load(target, prompts, args.request_timeout_s))
        finally:
            sampler.stop()
        seconds = time.monotonic() - t0
        refusals = gateway_refusals(mesh)
        alive = {p.name: p.popen.poll() is None for p in mesh.processes}
    finally:
        mesh.stop()
    hinted = [id(r) in target.retry_after_ms for r in prompts]
    per_request = [
        {
            "arrival_s": round(float(result.arrival_s[i]), 3),
            "prompt_tokens": int(result.prompt_tokens[i]),
            "max_tokens": int(result.expected_tokens[i]),
            "status": result.error[i] or "OK",
            "ttft_ms": g.round3(float(result.ttft_s[i]) * 1000),
            "tpot_ms": g.round3(float(result.tpot_s[i]) * 1000),
            "retry_after_ms": target.retry_after_ms.get(id(r)),
        }
        for i, r in enumerate(prompts)
    ]
    hints = [target.retry_after_ms[id(r)] for r in prompts if id(r) in target.retry_after_ms]
    out = summarize(result, slo, hinted, hints)
    out.update(
        label=label,
        seconds=round(seconds, 1),
        refusals_by_rule=refusals,
        processes_alive_at_end=alive,
        requests=per_request,
        warm_up={"ttft_ms": round(warm.ttft_s * 1000, 1), "tpot_ms": round(warm.tpot_s * 1000, 1)},
        rss={
            name: {
                "start": at_start.get(name),
                "idle": idle.get(name, sampler.samples.get(name, [None])[0]),
                "peak": max([*sampler.samples.get(name, []), idle.get(name, 0)]),
                "samples": len(sampler.samples.get(name, [])),
                "role": sampler.role[name],
            }
            for name in sorted(set(idle) | set(sampler.samples), key=process_order)
        },
    )
    return out


def warm_up_sizes(target: GrpcTarget, vocab: int) -> None:
    """Eight sequential 2-token requests, prompts 64 to 512 tokens: prefill batches spanning a
    range of sizes, which the gateway's TTFT prediction needs before it predicts anything
    (`admission.FIT_MIN_SAMPLES`), as on a mesh that has served traffic before the overload."""
    for i, n in enumerate(np.geomspace(64, 512, 8).round().astype(int)):
        one = Requests(np.zeros(1), np.array([n]), np.array([2]))
        g.run(target, one, vocab, seed=2000 + i)


def summarize(r: LoadResult, slo: Slo, hinted: list[bool], hints: list[int]) -> dict:
    """Offered, accepted, refused (with a retry hint or not), failed otherwise; latency and
    attainment among the accepted; goodput achieved."""
    ok = r.ok
    refused = np.array([e == "RESOURCE_EXHAUSTED" for e in r.error])
    other = ~ok & ~refused
    met = r.met(slo)
    failures = Counter(
        f"{r.error[i] or 'no tokens'}: {r.error_message[i][:120]}" for i in np.flatnonzero(other)
    )
    accepted = int(ok.sum())

    def pct(values: np.ndarray) -> dict:
        return {k: g.round3(v * 1000) for k, v in r.percentiles(values, (50, 90, 99)).items()}

    return {
        "offered": len(r),
        "offered_rps": round(len(r) / float(r.arrival_s.max()), 4) if len(r) else 0.0,
        "accepted": accepted,
        "refused": int(refused.sum()),
        "refused_with_retry_hint": int((refused & np.array(hinted)).sum()),
        "retry_after_ms": {
            "min": min(hints, default=None),
            "median": int(statistics.median(hints)) if hints else None,
            "max": max(hints, default=None),
        },
        "failed_other": int(other.sum()),
        "failures": dict(failures.most_common()),
        "attainment_accepted": round(float(met[ok].mean()), 4) if accepted else None,
        "attainment_offered": round(float(met.mean()), 4) if len(r) else None,
        "met_slo": int(met.sum()),
        "ttft_ms": pct(r.ttft_s),
        "tpot_ms": pct(r.tpot_s),
        "duration_s": round(r.duration_s, 2),
        "goodput_rps": round(int(met.sum()) / r.duration_s, 4) if r.duration_s else 0.0,
        "send_lag_max_ms": g.round3(float(np.nanmax(r.send_lag_s)) * 1000) if len(r) else None,
    }


def process_order(name: str) -> tuple:
    base = name.split("/")[0]
    return ({"gateway": 0, "prefill": 1, "decode": 2}.get(role_of(base), 3), name)


# -- report -------------------------------------------------------------------------------------


def log(text: str) -> None:
    print(f"overload {time.strftime('%H:%M:%S')}: {text}", file=sys.stderr, flush=True)


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def mib(x: int | None) -> str:
    return "-" if x is None else f"{x / MiB:,.0f}"


def run_table(on: dict, off: dict) -> str:
    rows = [
        ("offered (requests, req/s)", lambda r: f"{r['offered']} @ {r['offered_rps']:.2f}"),
        ("accepted (answered with tokens)", lambda r: str(r["accepted"])),
        (
            "refused RESOURCE_EXHAUSTED (retry hint)",
            lambda r: f"{r['refused']} ({r['refused_with_retry_hint']})",
        ),
        (
            "  by rule (gateway metric)",
            lambda r: ", ".join(f"{k} {v:.0f}" for k, v in r["refusals_by_rule"].items()) or "-",
        ),
        ("failed otherwise", lambda r: str(r["failed_other"])),
        ("attainment among accepted", lambda r: fmt(r["attainment_accepted"], ".3f")),
        ("attainment among offered", lambda r: fmt(r["attainment_offered"], ".3f")),
        ("TTFT p50/p90/p99 ms (accepted)", lambda r: triple(r["ttft_ms"], ".0f")),
        ("TPOT p50/p90/p99 ms (accepted)", lambda r: triple(r["tpot_ms"], ".1f")),
        ("goodput achieved req/s", lambda r: f"{r['goodput_rps']:.3f}"),
        ("first send to last reply s", lambda r: f"{r['duration_s']:.1f}"),
    ]
    lines = [f"{'':<42} {'admission on':>22} {'baseline (off)':>22}"]
    for name, cell in rows:
        lines.append(f"{name:<42} {cell(on):>22} {cell(off):>22}")
    return "\n".join(lines)


def triple(p: dict, spec: str) -> str:
    return "/".join(fmt(p[k], spec) for k in ("p50", "p90", "p99"))


def memory_table(on: dict, off: dict, bounds: dict) -> tuple[str, dict, bool]:
    """The per-process memory table and its JSON, and whether every process of the admission-on
    run stayed within its bound."""
    lines = [
        f"{'process (VmRSS MiB)':<28} {'start':>6} {'idle':>6} {'peak':>6} {'+':>5} "
        f"{'bound':>6} {'within':>6} | {'baseline idle':>13} {'peak':>6} {'+':>6}"
    ]
    out, within_all = {}, True
    names = sorted(set(on["rss"]) | set(off["rss"]), key=process_order)
    for name in names:
        a, b = on["rss"].get(name), off["rss"].get(name)
        row = {}
        if a is not None:
            bound = a["idle"] + bounds[a["role"]]["total"]
            within = a["peak"] <= bound
            within_all &= within
            row.update(idle=a["idle"], peak=a["peak"], start=a["start"], bound=bound, within=within)
        if b is not None:
            row["baseline"] = {"idle": b["idle"], "peak": b["peak"], "start": b["start"]}
        out[name] = row
        lines.append(
            f"{name:<28} {mib(a and a['start']):>6} {mib(a and a['idle']):>6} "
            f"{mib(a and a['peak']):>6} {mib(a and a['peak'] - a['idle']):>5} "
            f"{mib(row.get('bound')):>6} {('yes' if row['within'] else 'NO') if a else '-':>6} | "
            f"{mib(b and b['idle']):>13} {mib(b and b['peak']):>6} "
            f"{mib(b and b['peak'] - b['idle']):>6}"
        )
    return "\n".join(lines), out, within_all


def hardware() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} x {cpu}, torch {metadata.version('torch')}"


# -- main ---------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="chat", help="chat | code | summarization | ...")
    ap.add_argument("--factor", type=float, default=5.0, help="overload: this x the goodput rate")
    ap.add_argument("--duration-s", type=float, default=90.0, help="offered load per run")
    ap.add_argument("--requests-per-probe", type=int, default=24)
    ap.add_argument("--max-probes", type=int, default=5)
    ap.add_argument("--goodput-rps", type=float, help="skip the search: use this goodput")
    ap.add_argument("--slo", help="TTFT_MS,TPOT_MS (default: 5x / 3x the unloaded median)")
    ap.add_argument("--request-timeout-s", type=float, default=120.0)
    ap.add_argument("--sample-s", type=float, default=0.5, help="memory sampling interval")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", choices=("small", "tiny"), default="small")
    ap.add_argument(
        "--cold-start",
        action="store_true",
        help="no warm-up of varied sizes: the overload hits a mesh whose TTFT predictor has no "
        "fit yet (as right after start)",
    )
    ap.add_argument(
        "--admission-ttft-factor",
        type=float,
        help="admission-on run: this --admission-ttft-factor (default: the gateway's)",
    )
    ap.add_argument(
        "--out", type=Path, help="also write the JSON report here, with every request's record"
    )
    args = ap.parse_args()

    started = time.monotonic()
    load_before = os.getloadavg()
    model = default_model(args.preset)
    cfg = ModelConfig.from_dir(model)
    vocab = cfg.vocab_size
    workload = g.resolve_workload(args.workload, "poisson", model)
    base = workload.sample(args.requests_per_probe, args.seed)
    spec = mesh_spec(BenchSpec(model=model, workload=args.workload), "disaggregated")
    admission = AdmissionConfig()  # the gateway's defaults
    engine = engine_options(WORKER_ARGS)

    # 1. SLO and goodput, admission off.
    search = None
    unloaded = None
    probe_errors: Counter[str] = Counter()
    if args.slo and args.goodput_rps:
        slo = Slo.parse(args.slo)
        goodput, goodput_found = args.goodput_rps, True
    else:
        log("goodput search: starting the mesh (admission off)")
        with Mesh(dataclasses.replace(spec, gateway_args=ADMISSION_OFF)) as mesh:
            target = GrpcTarget(mesh.gateway_address)
            unloaded = g.unloaded(target, base, vocab)
            slo = Slo.parse(args.slo) if args.slo else g.slo_from_unloaded(unloaded)
            log(
                f"unloaded median request: TTFT {unloaded.ttft_s * 1000:.0f} ms, TPOT "
                f"{unloaded.tpot_s * 1000:.1f} ms; SLO {slo.ttft_s * 1000:.0f} / "
                f"{slo.tpot_s * 1000:.1f} ms"
            )
            if args.goodput_rps:
                goodput, goodput_found = args.goodput_rps, True
            else:
                lo, hi = g.rate_range(unloaded, len(mesh.workers))

                def measure(rate: float) -> g.Probe:
                    # g.measure, keeping the failures' statuses for the report
                    result = g.run(target, base.at_rate(rate), vocab, args.seed)
                    for e, m in zip(result.error, result.error_message, strict=True):
                        if e is not None:
                            probe_errors[f"{e}: {m[:120]}"] += 1
                    return g.Probe.of(rate, result, slo)

                search = g.search_goodput(
                    measure,
                    rate_lo=lo,
                    rate_hi=hi,
                    max_probes=args.max_probes,
                    on_probe=lambda p: log(
                        f"probe {p.rate:.3f} req/s: attainment {p.attainment:.2f} "
                        f"({p.errors} errors, {p.duration_s:.0f} s)"
                    ),
                )
                goodput_found = search.goodput > 0
                # None met alpha: fall back to the lowest rate probed (flagged in the output).
                goodput = search.goodput or min(p.rate for p in search.probes)
    rate = args.factor * goodput
    n = max(2, math.ceil(args.duration_s * rate))
    over = workload.sample(n, args.seed + 1)
    over = over.at_rate(over.arrival_s[-1] / args.duration_s)  # exactly n over duration_s
    log(f"goodput {goodput:.3f} req/s; overload {rate:.3f} req/s, {n} requests")

    # 2. The two overload runs, each on a fresh mesh.
    slo_args = (
        "--slo-ttft-ms",
        f"{slo.ttft_s * 1000:.3f}",
        "--slo-tpot-ms",
        f"{slo.tpot_s * 1000:.3f}",
    )
    factor_args = ()
    if args.admission_ttft_factor is not None:
        factor_args = ("--admission-ttft-factor", f"{args.admission_ttft_factor:g}")
    on = overload_run(
        "admission on",
        dataclasses.replace(spec, gateway_args=(*slo_args, *factor_args)),
        base,
        over,
        slo,
        vocab,
        args,
    )
    off = overload_run(
        "baseline",
        dataclasses.replace(spec, gateway_args=(*slo_args, *ADMISSION_OFF)),
        base,
        over,
        slo,
        vocab,
        args,
    )

    # 3. Report.
    bounds = {
        role: allowance(role, cfg, engine, admission.max_inflight)
        for role in ("gateway", "prefill", "decode")
    }
    mem_text, mem, within = memory_table(on, off, bounds)
    attained = on["attainment_accepted"] is not None and on["attainment_accepted"] >= 0.9
    print(
        f"hardware: {hardware()}; load average before {load_before[0]:.1f}, after "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(
        f"model: {args.preset} preset ({cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"heads {cfg.num_heads}/{cfg.num_kv_heads}, fp32); mesh 1 prefill + 1 decode, pinned, "
        f"{' '.join(WORKER_ARGS)}"
    )
    print(
        f"workload {workload.name}, Poisson; SLO TTFT {slo.ttft_s * 1000:.0f} ms / TPOT "
        f"{slo.tpot_s * 1000:.1f} ms"
        + (
            f" (5x / 3x the unloaded median request: {unloaded.ttft_s * 1000:.0f} / "
            f"{unloaded.tpot_s * 1000:.1f} ms)"
            if unloaded and not args.slo
            else " (given)"
        )
    )
    if search is not None:
        probes = ", ".join(
            f"{p.rate:.3f}: {p.attainment:.2f}" for p in sorted(search.probes, key=lambda p: p.rate)
        )
        print(
            f"goodput search (rate req/s: attainment; {args.requests_per_probe} requests each): "
            f"{probes}"
        )
        if probe_errors:
            print(f"goodput search failures (admission off): {dict(probe_errors)}")
    print(
        f"goodput {goodput:.3f} req/s{'' if goodput_found else ' (no probe met 0.9: lowest)'}"
        f"; offered {args.factor:g}x = {rate:.3f} req/s for {args.duration_s:g} s"
    )
    factor = args.admission_ttft_factor
    print(
        f"admission on: gateway defaults, --admission-ttft-factor "
        f"{admission.ttft_factor if factor is None else factor:g}, --max-inflight "
        f"{admission.max_inflight}, the gateway told the SLO; warm-up: "
        f"{'none of varied sizes (cold start)' if args.cold_start else 'varied sizes'}"
    )
    print()
    print(run_table(on, off))
    for r in (on, off):
        if r["failures"]:
            print(f"{r['label']} failures: {r['failures']}")
    print()
    print(mem_text)
    for role, b in bounds.items():
        print(f"bound {role}: idle + {b['total'] / MiB:,.0f} MiB = {b['formula']}")
    print(
        "(baseline: admission off, in flight unbounded: no bound applies; its figures are for "
        "comparison)"
    )
    print()
    print(
        f"target: attainment among accepted >= 0.9 at {args.factor:g}x: "
        f"{'met' if attained else 'NOT met'} ({fmt(on['attainment_accepted'], '.3f')}); "
        f"memory within bound: {'yes' if within else 'NO'}; failed otherwise "
        f"{on['failed_other']} (must be 0)"
    )
    report = {
        "bench": "overload",
        "model": args.preset,
        "cpu_count": os.cpu_count(),
        "hardware": hardware(),
        "workload": workload.name,
        "slo_ms": {"ttft": round(slo.ttft_s * 1000, 3), "tpot": round(slo.tpot_s * 1000, 3)},
        "unloaded": unloaded.to_json() if unloaded else None,
        "search": search.to_json() if search else None,
        "search_failures": dict(probe_errors),
        "goodput_rps": round(goodput, 4),
        "goodput_found": goodput_found,
        "factor": args.factor,
        "offered_rps": on["offered_rps"],
        "duration_s": args.duration_s,
        "offered": on["offered"],
        "accepted": on["accepted"],
        "refused": on["refused"],
        "refused_with_retry_hint": on["refused_with_retry_hint"],
        "failed_other": on["failed_other"],
        "attainment_accepted": on["attainment_accepted"],
        "attainment_accepted_baseline": off["attainment_accepted"],
        "goodput_achieved_rps": on["goodput_rps"],
        "goodput_achieved_rps_baseline": off["goodput_rps"],
        "target_attainment_met": attained,
        "within_bound": within,
        "rss_bytes": mem,
        "bounds": {
            role: {"allowance_bytes": b["total"], "terms": b["terms"], "formula": b["formula"]}
            for role, b in bounds.items()
        },
        "admission_ttft_factor": admission.ttft_factor if factor is None else factor,
        "cold_start": args.cold_start,
        "runs": {"admission_on": strip(on), "baseline": strip(off)},
        "seconds": round(time.monotonic() - started, 1),
    }
    if args.out:
        full = {**report, "requests": {"admission_on": on["requests"], "baseline": off["requests"]}}
        args.out.write_text(json.dumps(full, indent=2) + "\n")
    print(json.dumps(report))
    return 0


def strip(run: dict) -> dict:
    return {k: v for k, v in run.items() if k not in ("rss", "requests")}


if __name__ == "__main__":
    sys.exit(main())
