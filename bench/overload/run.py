"""One overload run of the overload bench (`bench/overload/overload.py`): a fresh mesh warmed up,
its idle memory read, the load offered with every refusal's retry hint kept, and its summary and
table."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections import Counter

import grpc
import numpy as np

from bench.overload.memory import RssSampler, process_order
from distserve.loadgen import goodput as g
from distserve.loadgen.requests import load_requests
from distserve.loadgen.results import LoadResult
from distserve.loadgen.runner import run_load
from distserve.loadgen.scrape import by_label, gateway
from distserve.loadgen.targets import GrpcTarget, LoadError
from distserve.local_mesh import Mesh, MeshSpec
from services.common.slo import Slo
from services.planner.workload import Requests


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
        # `distserve_admission_refusals_total` by reason, from the gateway's /metrics
        refusals = by_label(gateway(mesh).metrics(), "distserve_admission_refusals_total", "reason")
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


def log(text: str) -> None:
    print(f"overload {time.strftime('%H:%M:%S')}: {text}", file=sys.stderr, flush=True)


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


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
