"""Conditional disaggregation on a mixed workload: short prompts prefilled on the decode instance.

One mesh of 1 prefill + 1 decode (`small` model, 12 layers, 105M parameters, fp32; each worker
pinned to its own core; the engine options of `distserve bench goodput`; the gateway's admission
off), started twice, identical but for the gateway's rule:
  * off: every prompt goes through the prefill instance (`--local-prefill-max-tokens 0`);
  * on: the rule from this machine's latency profile (`--profile FILE`, what `distserve profile
    --quick` writes at the start of the run): a prompt of L tokens is prefilled on the decode
    instance when prefill_ms(L) <= the TPOT SLO - a decode step of 16 sequences of 512 tokens,
    and that instance has headroom (docs/deployment.md, "Conditional disaggregation").
The SLO: TTFT 5x the unloaded TTFT of a long request (`distserve bench goodput`'s rule),
measured on the off mesh; TPOT `--tpot-slo-ms` (150: about 3x the unloaded TPOT here, which
measured 41-50 ms; a fixed figure because the rule's threshold sits on it: with 3x a TPOT
measured at 41 ms, the slack over a profiled decode step of ~88 ms fitted no prompt at all, at
50 ms it fitted 12 tokens). The on mesh's gateway gets that TPOT SLO. The
workload: Poisson arrivals, half short prompts (lengths uniform in [T/2, T], T the profile's
threshold) and half long (LONG tokens), OUTPUT tokens each, at the rate that keeps the prefill
instance LOAD busy with the long prompts alone. Each of `--rounds` rounds runs the same seeded
requests on off, then on (both meshes stay up; the idle one costs next to nothing).

Reported per mode, pooled over rounds: short and long prompts' TTFT p50 / p90, TPOT attainment
(the fraction of requests whose TPOT met the SLO: the decode instance's side) and joint
attainment, and how the gateway routed (`distserve_routes_total`). Prints a table and one JSON
line. Sized for about 10 minutes on 2 cores.

    .venv/bin/python bench/conditional/conditional.py [--requests 48] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distserve.loadgen.comparison import ADMISSION_OFF, WORKER_ARGS
from distserve.loadgen.report import host
from distserve.loadgen.requests import FIRST_ORDINARY_ID, LoadRequest, poisson_arrivals
from distserve.loadgen.results import LoadResult
from distserve.loadgen.runner import run_load
from distserve.loadgen.scrape import by_label, gateway
from distserve.loadgen.targets import GrpcTarget
from distserve.local_mesh import Mesh, MeshSpec
from services.common.model_config import ModelConfig
from services.common.slo import Slo
from services.common.stats import percentile
from services.engine.presets import default_model
from services.gateway.conditional import LocalPrefill

LONG = 512  # tokens of a long prompt
OUTPUT = 32  # tokens asked for, every request
LOAD = 0.6  # share of the prefill instance the long prompts alone keep busy
MODES = ("off", "on")
ROUTES = ("distserve_routes_total", "route")  # how the gateway routed, by route


def profile(model: Path, out: Path) -> None:
    distserve = Path(sys.executable).parent / "distserve"
    subprocess.run(
        [
            str(distserve),
            "profile",
            "--model",
            str(model),
            "--quick",
            "--no-progress",
            "--out",
            str(out),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def prompt(rng: np.random.Generator, n: int, vocab: int) -> tuple[int, ...]:
    return tuple(rng.integers(FIRST_ORDINARY_ID, vocab, n).tolist())


def unloaded(address: str, vocab: int) -> tuple[float, float]:
    """TTFT and TPOT (s, medians) of a long request alone: 4 requests, 4 s apart."""
    rng = np.random.default_rng(1)
    reqs = [LoadRequest(4.0 * i, prompt(rng, LONG, vocab), OUTPUT) for i in range(4)]
    result = asyncio.run(run_load(GrpcTarget(address), reqs))
    if not result.ok.all():
        raise SystemExit(f"unloaded requests failed: {set(result.error_message)}")
    return float(np.median(result.ttft_s[1:])), float(np.median(result.tpot_s[1:]))


def workload(n: int, rate: float, threshold: int, vocab: int, seed: int) -> list[LoadRequest]:
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(rng, rate, n)
    out = []
    for i, t in enumerate(arrivals):
        length = int(rng.integers(max(1, threshold // 2), threshold + 1)) if i % 2 else LONG
        out.append(LoadRequest(float(t), prompt(rng, length, vocab), OUTPUT))
    return out


def start(model: Path, gateway_args: tuple[str, ...]) -> Mesh:
    mesh = Mesh(
        MeshSpec(
            model=model,
            gateway_port=0,
            pin=True,
            worker_args=WORKER_ARGS,
            gateway_args=(*ADMISSION_OFF, *gateway_args),
            prefill=1,
            decode=1,
        )
    )
    mesh.start()
    return mesh


def pct(values: np.ndarray, q: float) -> float:
    """The q-th percentile of the values that are not NaN (failed requests), in ms."""
    return percentile(values[~np.isnan(values)], q) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48, help="per round and mode")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tpot-slo-ms", type=float, default=150.0)
    args = ap.parse_args()
    model = default_model("small")
    vocab = ModelConfig.from_dir(model).vocab_size
    tmp = Path(tempfile.mkdtemp(prefix="bench-conditional-"))
    profile_file = tmp / "profile.json"
    t0 = time.monotonic()
    profile(model, profile_file)
    print(f"profiled in {time.monotonic() - t0:.0f} s", flush=True)
    meshes: dict[str, Mesh] = {}
    try:
        meshes["off"] = start(model, ("--local-prefill-max-tokens", "0"))
        ttft, tpot = unloaded(meshes["off"].gateway_address, vocab)
        slo = Slo(5 * ttft, args.tpot_slo_ms / 1000)
        rule = LocalPrefill.from_profile(profile_file, slo.tpot_s * 1000)
        threshold = rule.max_tokens
        print(
            f"unloaded long request: TTFT {ttft * 1000:.0f} ms, TPOT {tpot * 1000:.1f} ms; SLO "
            f"{slo.ttft_s * 1000:.0f} / {slo.tpot_s * 1000:.1f} ms; local prefill up to "
            f"{threshold} tokens ({rule.rule})",
            flush=True,
        )
        if threshold < 2:
            raise SystemExit("the profile leaves no prompt short enough to prefill locally")
        meshes["on"] = start(
            model, ("--profile", str(profile_file), "--slo-tpot-ms", str(slo.tpot_s * 1000))
        )
        rate = 2 * LOAD / ttft  # half the requests are long; each takes ~ttft of prefill
        results: dict[str, list[LoadResult]] = {m: [] for m in MODES}
        routed: dict[str, dict[str, float]] = {m: {} for m in MODES}
        for r in range(args.rounds):
            reqs = workload(args.requests, rate, threshold, vocab, seed=100 + r)
            for mode in MODES:
                before = by_label(gateway(meshes[mode]).metrics(), *ROUTES)
                result = asyncio.run(run_load(GrpcTarget(meshes[mode].gateway_address), reqs))
                after = by_label(gateway(meshes[mode]).metrics(), *ROUTES)
                results[mode].append(result)
                for route, n in after.items():
                    routed[mode][route] = routed[mode].get(route, 0) + n - before.get(route, 0)
                print(
                    f"round {r + 1}/{args.rounds} {mode}: {int(result.ok.sum())}/{len(result)} "
                    f"ok, joint attainment {result.attainment(slo):.2f}",
                    flush=True,
                )
    finally:
        for mesh in meshes.values():
            mesh.stop()

    def pooled(mode: str, field: str) -> np.ndarray:
        return np.concatenate([getattr(r, field) for r in results[mode]])

    rows = {}
    for mode in MODES:
        prompt_tokens = pooled(mode, "prompt_tokens")
        ttft_s, tpot_s = pooled(mode, "ttft_s"), pooled(mode, "tpot_s")
        ok = np.concatenate([r.ok for r in results[mode]])
        short = prompt_tokens < LONG
        with np.errstate(invalid="ignore"):
            tpot_met = ok & (tpot_s <= slo.tpot_s)
            joint = np.concatenate([r.met(slo) for r in results[mode]])
        rows[mode] = {
            "short_ttft_ms": {"p50": pct(ttft_s[short], 50), "p90": pct(ttft_s[short], 90)},
            "long_ttft_ms": {"p50": pct(ttft_s[~short], 50), "p90": pct(ttft_s[~short], 90)},
            "tpot_ms": {"p50": pct(tpot_s, 50), "p99": pct(tpot_s, 99)},
            "tpot_attainment": float(tpot_met.mean()),
            "tpot_attainment_long": float(tpot_met[~short].mean()),
            "joint_attainment": float(joint.mean()),
            "failed": int((~ok).sum()),
            "routes": {k: int(v) for k, v in routed[mode].items() if v},
        }
    print()
    print(f"hardware: {host()}")
    print(
        f"model: small (105M, fp32), 1 prefill + 1 decode pinned; {args.rounds} rounds x "
        f"{args.requests} requests, Poisson {rate:.2f} req/s, half {LONG}-token prompts, half "
        f"{max(1, threshold // 2)}-{threshold}; {OUTPUT} tokens each; SLO "
        f"{slo.ttft_s * 1000:.0f} / {slo.tpot_s * 1000:.1f} ms"
    )
    print(
        f"{'rule':5} {'short TTFT p50/p90 ms':>22} {'long TTFT p50/p90 ms':>21} "
        f"{'TPOT p50/p99 ms':>16} {'TPOT met':>9} {'(long)':>7} {'joint':>6}  routes"
    )
    for mode, row in rows.items():
        s, lg, tp = row["short_ttft_ms"], row["long_ttft_ms"], row["tpot_ms"]
        print(
            f"{mode:5} {s['p50']:10.0f} / {s['p90']:8.0f} {lg['p50']:10.0f} / {lg['p90']:7.0f} "
            f"{tp['p50']:7.1f} / {tp['p99']:6.1f} {row['tpot_attainment']:9.2f} "
            f"{row['tpot_attainment_long']:7.2f} {row['joint_attainment']:6.2f}  {row['routes']}"
        )
    summary = {
        "bench": "conditional",
        "model": "small",
        "cpu_count": os.cpu_count(),
        "requests": args.requests * args.rounds,
        "rate_rps": round(rate, 3),
        "long_tokens": LONG,
        "short_tokens": [max(1, threshold // 2), threshold],
        "output_tokens": OUTPUT,
        "slo_ms": {"ttft": round(slo.ttft_s * 1000, 1), "tpot": round(slo.tpot_s * 1000, 2)},
        "local_prefill_max_tokens": threshold,
        "local_prefill_rule": rule.rule,
        "modes": rows,
        "short_ttft_p90_ratio": round(
            rows["on"]["short_ttft_ms"]["p90"] / rows["off"]["short_ttft_ms"]["p90"], 3
        ),
        "tpot_attainment_change": round(
            rows["on"]["tpot_attainment"] - rows["off"]["tpot_attainment"], 3
        ),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
