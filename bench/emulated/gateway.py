"""One gateway's ceiling: 16 prefill and 16 decode emulated A100s (OPT-13B) behind one gateway,
at the device's own speed (time scale 1: decode steps of ~20 ms, one token a message, as on a
real deployment), offered more and more tokens until the gateway (or this host) saturates.

Each probe offers Poisson arrivals for `PROBE_S` seconds of prompts of 32-128 tokens and
`OUTPUT_TOKENS`-token answers, at double the rate of the one before, until the gateway's CPU
passes 90% of a core, the host's CPU 90% of its cores, or the median TPOT 1.5x the first
probe's. The figures: the most tokens/s delivered, the gateway's CPU per token beyond its idle
cost (32 workers' load reports), so the tokens/s one gateway core forwards, the whole host's CPU
beside it (on a 2-core host the 32 workers and the load generator share the cores: whichever
saturates first is named), and where the gateway's CPU goes at the last probe (py-spy: the top 5
functions by own time, and the top 5 of the mesh's own code by inclusive time).

Used by bench/emulated/emulated.py (`--parts gateway`); alone: `python bench/emulated/gateway.py`.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distserve.loadgen.emulated import EmulatedCluster, Shape, run
from distserve.loadgen.emulated_mesh import mesh_cpu_seconds
from distserve.loadgen.procfs import cpu_seconds, host_cpu_seconds
from distserve.local_mesh import Mesh
from services.engine.presets import emulated_model
from services.planner.workload import LengthDist, Workload

OUTPUT_TOKENS = 200
PROBE_S = 8.0
FIRST_RATE = 10.0
MAX_PROBES = 7
IDLE_S = 5.0


def top_functions(raw: str, n: int = 5) -> dict[str, list[dict]]:
    """From py-spy's raw (collapsed stack) output: the n functions with the most own samples,
    and the n of the mesh's code (services/) in the most samples' stacks."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        own[frames[-1]] += int(count)
        for frame in set(frames):
            if "services/" in frame:
                inclusive[frame] += int(count)
    total = sum(own.values()) or 1

    def top(counter: collections.Counter) -> list[dict]:
        return [{"function": f, "share": round(c / total, 3)} for f, c in counter.most_common(n)]

    return {"own": top(own), "inclusive_services": top(inclusive)}


def profile_gateway(pid: int, seconds: float, folder: Path) -> dict[str, list[dict]]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out = folder / "gateway.raw"
    try:
        subprocess.run(
            [
                spy,
                "record",
                "-p",
                str(pid),
                "-d",
                str(int(seconds)),
                "-r",
                "200",
                "-f",
                "raw",
                "-o",
                str(out),
                "--nonblocking",
            ],
            check=True,
            capture_output=True,
            timeout=seconds + 60,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return {"own": [{"function": f"py-spy failed: {e}", "share": 0.0}]}
    return top_functions(out.read_text())


def measure(log=print) -> dict:
    workload = Workload(
        "gateway",
        LengthDist("uniform", low=32, high=128),
        LengthDist("fixed", OUTPUT_TOKENS, 0, OUTPUT_TOKENS, OUTPUT_TOKENS),
    )
    probes = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cluster = EmulatedCluster.of("opt-13b")
        shape = Shape(prefill=(16, 1), decode=(16, 1))
        started = time.time()
        spec = cluster.mesh_spec(shape, emulated_model(cluster.model), 1.0, ready_timeout_s=600)
        with Mesh(spec) as mesh:
            log(f"  16P16D up in {time.time() - started:.0f} s")
            gateway = next(p for p in mesh.processes if p.name == "gateway").popen.pid
            g0 = cpu_seconds(gateway)
            time.sleep(IDLE_S)
            idle = (cpu_seconds(gateway) - g0) / IDLE_S  # cores: load reports, metrics
            rate, top = FIRST_RATE, {}
            for i in range(MAX_PROBES):
                n = max(20, int(rate * PROBE_S))
                requests = workload.sample(n, seed=i).at_rate(rate)
                last = i == MAX_PROBES - 1
                g0, h0, m0, t0 = (
                    cpu_seconds(gateway),
                    host_cpu_seconds(),
                    mesh_cpu_seconds(mesh),
                    time.time(),
                )
                if last or (probes and probes[-1]["gateway_cpu_cores"] > 0.6):
                    # profile this probe's middle (it may be the last)
                    spy = SpyInBackground(gateway, PROBE_S / 2, folder)
                else:
                    spy = None
                result = run(mesh, 1.0, requests, 933, seed=i)
                wall = time.time() - t0
                if spy is not None:
                    spy.join()
                    top = spy.result
                tokens = int(result.output_tokens.sum())
                cpu_seconds(gateway) - g0
                offered = rate * OUTPUT_TOKENS
                probe = {
                    "rate_rps": rate,
                    "offered_tokens_per_s": round(offered),
                    "delivered_tokens_per_s": round(tokens / result.duration_s),
                    "errors": int((~result.ok).sum()),
                    "tpot_p50_ms": round(float(np.nanmedian(result.tpot_s)) * 1000, 2),
                    "gateway_cpu_cores": round((cpu_seconds(gateway) - g0) / wall, 3),
                    "gateway_cpu_us_per_token": round(
                        (cpu_seconds(gateway) - g0) / tokens * 1e6, 1
                    ),
                    "mesh_cpu_cores": round((mesh_cpu_seconds(mesh) - m0) / wall, 3),
                    "host_cpu_cores": round((host_cpu_seconds() - h0) / wall, 3),
                }
                log(f"  {probe}")
                probes.append(probe)
                saturated = (
                    probe["gateway_cpu_cores"] > 0.9
                    or probe["host_cpu_cores"] > 0.9 * os.cpu_count()
                    or probe["tpot_p50_ms"] > 1.5 * probes[0]["tpot_p50_ms"]
                    or probe["errors"]
                )
                if saturated:
                    if not top:
                        top = profile_gateway(gateway, PROBE_S, folder)  # already past it
                    break
                rate *= 2
    best = max(probes, key=lambda p: p["delivered_tokens_per_s"])
    last = probes[-1]
    limit = "gateway" if last["gateway_cpu_cores"] > 0.9 else "host"
    if len(probes) == MAX_PROBES and not saturated:
        limit = "none (the probes ran out)"
    return {
        "engine": "emulated OPT-13B on A100s (DistServe's profile), time scale 1",
        "shape": "16P16D",
        "gateway_idle_cpu_cores": round(idle, 4),
        "gateway_max_tokens_per_s_32_workers": best["delivered_tokens_per_s"],
        "gateway_cpu_us_per_token": best["gateway_cpu_us_per_token"],
        "tokens_per_s_per_gateway_core": round(1e6 / best["gateway_cpu_us_per_token"]),
        "saturated_by": limit,
        "gateway_cpu_top5": top,
        "probes": probes,
    }


class SpyInBackground:
    """py-spy on the gateway for `seconds`, started after a quarter of a probe."""

    def __init__(self, pid: int, seconds: float, folder: Path) -> None:
        import threading

        self.result: dict[str, list[dict]] = {}

        def go() -> None:
            time.sleep(PROBE_S / 4)
            self.result = profile_gateway(pid, seconds, folder)

        self._thread = threading.Thread(target=go, daemon=True)
        self._thread.start()

    def join(self) -> None:
        self._thread.join()


if __name__ == "__main__":
    report = measure(lambda *a: print(*a, file=sys.stderr, flush=True))
    print(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "probes"}))
