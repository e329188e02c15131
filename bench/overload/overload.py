"""Overload: at 5x the goodput rate, do accepted requests still meet the SLO, and does every
process's resident memory stay within a documented bound?

Target: "under 5x the goodput rate, accepted requests still meet the SLO at >= 90% attainment and
each process's resident memory stays within a documented bound."

What runs, in one invocation (every mesh: 1 prefill + 1 decode, `distserve.local_mesh.Mesh`,
built by `distserve.loadgen.comparison.mesh_spec` exactly as `distserve bench goodput` builds its
disaggregated mode: each worker pinned to its own core with one torch thread, engine options
`distserve.loadgen.comparison.WORKER_ARGS` = `--kv-cache-gib 0.375 --max-num-seqs 16
--max-batch-tokens 2048`; no Envoy; the load goes over gRPC straight to the gateway):

1. **Goodput.** A first mesh, admission off (so that a refusal never counts as a miss and the
   rate found is what the mesh serves), gets the SLO by `distserve bench goodput`'s rule
   (`distserve.loadgen.goodput.unloaded` + `slo_from_unloaded`: 5x the unloaded TTFT, 3x the
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

**The bound**: idle + `allowance()`, term by term from what bounds memory in the code
(`bench/overload/memory.py` states each term and its constants).

Model and sizes: the `small` preset (12 layers, hidden 768, GQA 12/4, 105M parameters, fp32),
as `distserve bench goodput` uses, because `tiny` serves the chat workload in a few ms per
request, so that 5x its goodput would be hundreds of requests per second and the load generator
on these 2 cores would be the bottleneck, not the mesh; with `small` the prefill core saturates
at under 2 req/s, and a 1.2 GB worker makes the memory figures those of a real model.
Workload: the CPU-scaled `chat` (`distserve.loadgen.goodput.SCALED`: prompts lognormal 256 +- 200
tokens [16, 768], outputs 48 +- 40 [4, 128]), `--workload` takes another. Defaults are sized for
about 10-15 minutes on 2 shared cores: 24 requests per probe and at most 5 probes for the search
(as bench/goodput/goodput.py), 90 s of overload per run (the baseline then runs until its backlog is
served or times out). The gateway, the load generator and this process's sampler share the cores
with the pinned workers.

Prints the search, a table of both runs, the memory table with the bound, the hardware and model,
and last one JSON line `{"bench": "overload", ...}`.

    .venv/bin/python bench/overload/overload.py [--duration-s 90] [--factor 5] [--workload chat]
        [--requests-per-probe 24] [--max-probes 5] [--goodput-rps R] [--slo TTFT_MS,TPOT_MS]
        [--admission-ttft-factor F] [--cold-start] [--out overload.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


from bench.overload.memory import MiB, allowance, engine_options, memory_table
from bench.overload.run import fmt, log, overload_run, run_table
from distserve.loadgen import goodput as g
from distserve.loadgen.comparison import ADMISSION_OFF, WORKER_ARGS, BenchSpec, mesh_spec
from distserve.loadgen.report import host
from distserve.loadgen.targets import GrpcTarget
from distserve.local_mesh import Mesh
from services.common.model_config import ModelConfig
from services.common.slo import Slo
from services.engine.presets import default_model
from services.gateway.admission import AdmissionConfig


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
        f"hardware: {host(torch=True)}; load average before {load_before[0]:.1f}, after "
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
        "hardware": host(torch=True),
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
