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

    .venv/bin/python bench/chaos/chaos.py [--duration-s 300] [--rate 6] [--seed 0]
        [--cancellations 1000] [--out chaos.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

from bench.chaos.faults import (
    COUNTERS,
    FAULTED_PREFILL,
    Chaos,
    Ledger,
    fuzz_burst,
    malformed_bodies,
    mesh_spec,
    migrations,
    settle,
)
from bench.chaos.load import ChaosSpec, Outcome, Planned, plan, references, request
from distserve.loadgen.report import host, percentiles
from distserve.local_mesh import Mesh
from services.common import mesh_tls
from services.common.gen.distserve.v1 import (
    gateway_pb2_grpc,
)
from services.common.slo import Slo
from services.engine.presets import default_model

MOVED = re.compile(r"request (\S+): lost its serving instance")


# --- one run --------------------------------------------------------------------------------


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
    slo = Slo(spec.slo_ttft_ms / 1000, spec.slo_tpot_ms / 1000)
    met, ttft, tpot = 0, [], []
    for _, o in served:
        if o.kind != "exact":
            continue
        t1 = o.first_s - o.sent_s
        t2 = (o.last_s - o.first_s) / (len(o.tokens) - 1) if len(o.tokens) > 1 else 0.0
        ttft.append(t1)
        tpot.append(t2)
        met += slo.met(t1, t2)
    return {
        **kinds,
        "requests": len(outcomes),
        "client_cancellations": sum(p.cancel_after is not None for p in planned),
        "slo_met": met,
        "goodput_rps": round(met / spec.duration_s, 3),
        "ttft_ms": percentiles(ttft, (50, 99), scale=1000, ndigits=1),
        "tpot_ms": percentiles(tpot, (50, 99), scale=1000, ndigits=1),
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


def _failures(outcomes: list[Outcome]) -> dict:
    out: dict[str, int] = {}
    for o in outcomes:
        if o.kind in ("failed", "lost"):
            key = f"{o.kind} {o.status}: {o.message[:100]}"
            out[key] = out.get(key, 0) + 1
    return out


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
        "hardware": host(torch=True),
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
    print(f"\nChaos: tiny model, {spec.prefill}P{spec.decode}D, {host(torch=True)}")
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
