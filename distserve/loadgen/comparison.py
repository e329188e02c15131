"""Goodput of the disaggregated mesh against the colocated baseline on this host (what `distserve
bench goodput` runs): the meshes of both modes, the SLO, each mode's goodput search, the report
and its plots.

Each mode runs as a mesh of its workers, each pinned to a core with one torch thread
(`MeshSpec.pin`), with the same engine options (`WORKER_ARGS`) and the gateway's admission off
(`ADMISSION_OFF`: goodput is what the mesh serves in time, not what an admission told other
SLOs lets in). With both modes the two meshes run side by side (the idle one costs next to
nothing) so that the SLO can come from both: the rule is
`distserve.loadgen.goodput.slo_from_unloaded` (5x the unloaded TTFT, 3x the unloaded TPOT of the
workload's median request, the smaller of the two modes' for each) unless `BenchSpec.slo`
gives it. Both searches start from the same rate bracket, so they share their first probe, where
the TTFT and TPOT distributions are compared at equal load (the largest rate both probed).

Writes `goodput.json`, `attainment.png` (attainment vs rate, one line per mode) and
`latency_cdf.png` (TTFT and TPOT CDFs at equal load) into `BenchSpec.out`.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from distserve.loadgen.emulated import EmulatedCluster

MODES = ("disaggregated", "colocated")
# Engine options of every worker in both modes: a 384 MB KV pool (16k tokens of the `small`
# model at 24 KB/token: 16 sequences of 1,000 tokens), 16 decode seats, 2048-token prefill
# batches (L_m).
WORKER_ARGS = ("--kv-cache-gib", "0.375", "--max-num-seqs", "16", "--max-batch-tokens", "2048")
# The gateway's admission off (goodput is the mesh's capacity, not what its admission, told
# other SLOs than the bench's, lets in): no TTFT rule (which also skips the decode watermarks
# and seats), no in-flight limit this load could reach, watermarks that never trigger.
ADMISSION_OFF = (
    "--admission-ttft-factor",
    "0",
    "--max-inflight",
    "1000000",
    "--decode-pull-watermark",
    "1000000",
    "--decode-kv-watermark",
    "1.0",
)


@dataclass(frozen=True)
class BenchSpec:
    """One `bench goodput` run."""

    model: Path
    workload: str = "chat"
    modes: tuple[str, ...] = MODES
    arrivals: str = "poisson"
    slo: str | None = None  # "TTFT_MS,TPOT_MS"; None: from the unloaded latency
    requests: int = 24
    max_probes: int = 6
    rates: tuple[float, float] | None = None  # the first bracket; None: from the unloaded
    alpha: float = 0.9
    seed: int = 0
    protocol: str = "grpc"  # or "http"
    edge: bool = False  # through Envoy
    prefill: int = 1  # workers of the disaggregated mesh ...
    decode: int = 1
    colocated: int = 2  # ... and of the colocated one
    out: Path = Path("bench-goodput")
    progress: bool = True
    worker_args: tuple[str, ...] = WORKER_ARGS
    # The emulated engine (docs/engine.md): the cluster it models, and its mesh's time scale;
    # None: the real engine, one pinned core per worker.
    emulated: EmulatedCluster | None = None
    time_scale: float = 1.0


def mesh_spec(spec: BenchSpec, mode: str):
    """The mesh of one mode: its workers (`spec.prefill` + `spec.decode`, or `spec.colocated`),
    pinned, one core each; emulated, one emulated A100 each (the planner's engine limits)."""
    from distserve.local_mesh import MeshSpec
    from services.edge.config import EdgeConfig

    if mode == "disaggregated":
        roles = {"prefill": spec.prefill, "decode": spec.decode}
    else:
        roles = {"prefill": 0, "decode": 0, "colocated": spec.colocated}
    edge = EdgeConfig(port=0, rate_limit_rps=0, access_log="") if spec.edge else None
    if spec.emulated is not None:
        from distserve.loadgen.emulated import Shape

        shape = Shape(**{role: (n, 1) for role, n in roles.items()})
        return spec.emulated.mesh_spec(shape, spec.model, spec.time_scale, edge=edge)
    return MeshSpec(
        model=spec.model,
        gateway_port=0,
        pin=True,
        worker_args=spec.worker_args,
        gateway_args=ADMISSION_OFF,
        edge=edge,
        **roles,
    )


def target_of(mesh, spec: BenchSpec):
    from distserve.loadgen.targets import GrpcTarget, HttpTarget

    scale = spec.time_scale
    if spec.protocol == "grpc":
        return GrpcTarget(
            mesh.edge_address if spec.edge else mesh.gateway_address, time_scale=scale
        )
    address = mesh.edge_address if spec.edge else mesh.gateway_http_address
    return HttpTarget(f"http://{address}", time_scale=scale)


def run_bench(spec: BenchSpec) -> dict:
    """Start the modes' meshes, derive the SLO, search each mode's goodput, write the outputs;
    returns the report (as written to goodput.json). Every mesh is stopped before returning."""
    from tqdm import tqdm

    from distserve.loadgen import goodput as g
    from distserve.local_mesh import Mesh
    from services.common.model_config import ModelConfig
    from services.common.slo import Slo

    for mode in spec.modes:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}")
    # an emulated mesh serves the planner's workloads at full length (its devices are A100s)
    scaled = spec.emulated is None
    workload = g.resolve_workload(spec.workload, spec.arrivals, spec.model, scaled=scaled)
    base = workload.sample(spec.requests, spec.seed)
    vocab = ModelConfig.from_dir(spec.model).vocab_size
    meshes: dict[str, Mesh] = {}
    try:
        for mode in spec.modes:
            meshes[mode] = Mesh(mesh_spec(spec, mode))
            meshes[mode].start()
        targets = {mode: target_of(mesh, spec) for mode, mesh in meshes.items()}
        cores = {mode: len(mesh.workers) for mode, mesh in meshes.items()}
        alone = {mode: g.unloaded(targets[mode], base, vocab) for mode in spec.modes}
        slo = Slo.parse(spec.slo) if spec.slo else g.slo_from_unloaded(*alone.values())
        first = g.Unloaded(
            alone[spec.modes[0]].prompt_tokens,
            alone[spec.modes[0]].output_tokens,
            min(u.ttft_s for u in alone.values()),
            min(u.tpot_s for u in alone.values()),
        )
        lo, hi = spec.rates or g.rate_range(first, max(cores.values()))
        bar = tqdm(
            total=len(spec.modes) * spec.max_probes,
            desc="goodput",
            unit="probe",
            file=sys.stderr,
            disable=not spec.progress,
        )
        searches: dict[str, g.GoodputSearch] = {}
        with bar:
            for mode in spec.modes:
                bar.set_description(f"{workload.name} {mode}")

                def on_probe(p: g.Probe) -> None:
                    bar.update(1)
                    bar.set_postfix(rate=f"{p.rate:.3g}", attainment=f"{p.attainment:.2f}")

                searches[mode] = g.search_goodput(
                    lambda r, t=targets[mode]: g.measure(t, base, r, slo, vocab, spec.seed),
                    alpha=spec.alpha,
                    rate_lo=lo,
                    rate_hi=hi,
                    max_probes=spec.max_probes,
                    on_probe=on_probe,
                )
                bar.update(spec.max_probes - len(searches[mode].probes))
    finally:
        for mesh in meshes.values():
            mesh.stop()
    report = build_report(spec, workload.name, slo, alone, cores, searches)
    write_outputs(spec.out, report, searches)
    return report


def build_report(spec: BenchSpec, workload: str, slo, alone, cores, searches) -> dict:
    from distserve.loadgen import goodput as g

    modes = {}
    for mode, s in searches.items():
        modes[mode] = {
            "cores": cores[mode],
            **s.to_json(),
            "goodput_per_core_rps": round(s.goodput / cores[mode], 4),
            "unloaded": alone[mode].to_json(),
        }
    report = {
        "bench": "goodput",
        "model": spec.model.name,
        "workload": workload,
        "arrivals": spec.arrivals,
        "requests_per_probe": spec.requests,
        "worker_args": list(spec.worker_args),
        "protocol": spec.protocol + (" via envoy" if spec.edge else ""),
        "cpu_count": os.cpu_count(),
        # per core: one worker per core; emulated: one emulated device per worker, in emulated
        # time (docs/engine.md)
        "engine": "torch" if spec.emulated is None else "emulated",
        "time_scale": spec.time_scale,
        "slo": {"ttft_ms": round(slo.ttft_s * 1000, 3), "tpot_ms": round(slo.tpot_s * 1000, 3)},
        "slo_rule": "explicit"
        if spec.slo
        else f"{g.TTFT_SLO_FACTOR:g}x TTFT, {g.TPOT_SLO_FACTOR:g}x TPOT of the unloaded median "
        "request (smallest over the modes)",
        "modes": modes,
    }
    if set(searches) == set(MODES):
        d, c = (modes[m]["goodput_per_core_rps"] for m in MODES)
        report["ratio_per_core"] = round(d / c, 3) if c > 0 else None
    rate = g.equal_load_rate(*searches.values())
    if rate is not None:
        eq = {"rate_rps": round(rate, 4)}
        for mode, s in searches.items():
            p = s.at(rate)
            eq[mode] = {
                "attainment": round(p.attainment, 4),
                "ttft_p90_ms": p.ttft_ms["p90"],
                "tpot_p99_ms": p.tpot_ms["p99"],
                # per request, in ms (None: failed), for the CDFs
                "ttft_ms": [g.round3(x * 1000) for x in p.ttft_s],
                "tpot_ms": [g.round3(x * 1000) for x in p.tpot_s],
            }
        report["equal_load"] = eq
    return report


def write_outputs(out: Path, report: dict, searches: dict) -> None:
    """goodput.json, attainment.png and latency_cdf.png into `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out.mkdir(parents=True, exist_ok=True)
    (out / "goodput.json").write_text(json.dumps(report, indent=2) + "\n")

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, s in searches.items():
        probes = sorted(s.probes, key=lambda p: p.rate)
        ax.plot([p.rate for p in probes], [p.attainment for p in probes], "o-", label=mode)
    alpha = next(iter(searches.values())).alpha
    ax.axhline(alpha, color="grey", linestyle="--", linewidth=1, label=f"alpha = {alpha:g}")
    ax.set_xlabel("rate (requests/s)")
    ax.set_ylabel("SLO attainment (TTFT and TPOT)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(
        f"{report['workload']}: SLO {report['slo']['ttft_ms']:.0f} ms / "
        f"{report['slo']['tpot_ms']:.0f} ms"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "attainment.png", dpi=100)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    eq = report.get("equal_load", {})
    rate = eq.get("rate_rps")
    for mode in searches:
        if mode not in eq:
            continue
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms"), strict=True):
            v = np.sort([x for x in eq[mode][key] if x is not None])
            ax.step(v, np.arange(1, len(v) + 1) / max(1, len(v)), where="post", label=mode)
    for ax, name, limit in zip(
        axes, ("TTFT", "TPOT"), (report["slo"]["ttft_ms"], report["slo"]["tpot_ms"]), strict=True
    ):
        ax.axvline(limit, color="grey", linestyle="--", linewidth=1, label="SLO")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.legend()
    load = f"{rate:.3g} req/s" if rate is not None else "no common rate"
    fig.suptitle(f"{report['workload']}: latency at equal load ({load})")
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=100)
    plt.close(fig)


def describe(report: dict) -> str:
    """The comparison as a table."""
    slo = report["slo"]
    lines = [
        f"{report['workload']} on {report['model']}, {report['requests_per_probe']} requests per "
        f"probe, SLO TTFT {slo['ttft_ms']:.0f} ms / TPOT {slo['tpot_ms']:.1f} ms "
        f"({report['slo_rule']})",
        f"{'mode':<14} {'goodput req/s':>13} {'per core':>9} {'TTFT p90 ms':>12} "
        f"{'TPOT p99 ms':>12}",
    ]
    eq = report.get("equal_load", {})
    for mode, m in report["modes"].items():
        at = eq.get(mode, {})
        lines.append(
            f"{mode:<14} {m['goodput_rps']:>13.3f} {m['goodput_per_core_rps']:>9.3f} "
            f"{_fmt(at.get('ttft_p90_ms')):>12} {_fmt(at.get('tpot_p99_ms')):>12}"
        )
    if "rate_rps" in eq:
        lines.append(f"(latency percentiles at equal load: {eq['rate_rps']:.3g} req/s)")
    if report.get("ratio_per_core") is not None:
        lines.append(f"disaggregated / colocated per core: {report['ratio_per_core']:.2f}x")
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"
