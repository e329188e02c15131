"""Simulator fidelity: the planner's simulator, fed this machine's profile, against the real mesh.

The engine profile (`services.planner.profiler`, run pinned to one core with one torch thread,
as a `--pin` worker runs) times the engine's prefill and decode steps alone. A worker of the
mesh does more on its core than those steps: it serves gRPC (the prefill call, one streamed
message per decode token), holds and serves KV leases, pulls KV over UCX; and on a 2-core machine
the gateway and the load generator, which are not pinned, take their CPU from the same two cores.
None of that is in the engine profile, and on the tiny model it is most of the work.

So the comparison adds what the mesh costs beyond the engine, measured on the mesh itself in a
calibration run (its own seeded requests, at a low rate) and stated in `MeshCalibration`:

* CPU per request on each worker's core beyond the engine's steps (from /proc: process CPU time
  minus the engine time the profile predicts for the same requests), and the CPU of the unpinned
  processes (gateway, load generator) per request, half of it charged to each core;
  prefill's goes into the prefill fixed cost `a` (per batch: batches hold one prompt at these
  rates), decode's per output token into the decode per-sequence cost `c`;
* latency that occupies no worker core (the hops client -> gateway -> prefill -> client): the
  median unloaded TTFT beyond the prefill service time, added to every predicted TTFT;
* the KV hand-off: KV moves at the bandwidth measured by the decode instance (bytes pulled /
  seconds of its pulls), and the rest of the first-to-second token gap beyond one decode step
  (admission, pull set-up, join) is added to each request's decode time.

Then `simulate_1p1d` runs with the workers' real engine parameters (L_m, max_num_seqs, KV
capacity in tokens from the running decode instance) on the same seeded requests as the mesh.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import grpc
import numpy as np

from services.common.gen.distserve.v1 import common_pb2, decode_pb2_grpc
from services.common.model_config import ModelConfig
from services.loadgen.requests import load_requests
from services.loadgen.results import LoadResult
from services.loadgen.runner import run_load
from services.loadgen.targets import GrpcTarget
from services.planner.latency import Coefficients, LatencyModel, TpLatency
from services.planner.profiler import QUICK, ProfileGrid, _compositions
from services.planner.simulator import SimResult, Slo, simulate_1p1d
from services.planner.workload import LengthDist, Requests, Workload

# Prompts of 64..768 tokens (prefill a few ms), outputs of 32..160: with two decode seats the
# decode instance's seats bind at rates where the two cores still have room for the gateway and
# the load generator (the tiny model's per-token service costs otherwise saturate them first).
WORKLOAD = Workload(
    "fidelity", LengthDist("uniform", low=64, high=768), LengthDist("uniform", low=32, high=160)
)
BLOCK_SIZE = 16
# The engine options of every worker in the comparison: the simulator gets the same ones.
MAX_BATCH_TOKENS = 1024
MAX_NUM_SEQS = 2
KV_CACHE_MB = 16
WORKER_ARGS = (
    "--kv-cache-mb",
    str(KV_CACHE_MB),
    "--max-num-seqs",
    str(MAX_NUM_SEQS),
    "--max-batch-tokens",
    str(MAX_BATCH_TOKENS),
    "--block-size",
    str(BLOCK_SIZE),
)


# The profiler's QUICK grid, and a fuller one inside the tiny model's 1024-token context (the
# profiler's FULL grid has 1024- and 2048-token prompts, which the tiny model refuses).
GRIDS = {
    "quick": QUICK,
    "full": ProfileGrid(
        prefill_batches=_compositions((16, 64, 128, 256, 512, 768), (2, 4)),
        lm_tokens=(32, 64, 128, 256, 512, 768),
        decode_batches=(1, 2, 4, 8, 16),
        decode_contexts=(32, 128, 512),
        decode_steps=8,
        reps=5,
    ),
}


def profile_pinned(model_dir: Path, grid: str = "quick", cpu: int | None = None) -> dict:
    """The planner's profile of `model_dir`, measured as a `--pin` worker runs: in a process of
    its own pinned to one core (`cpu`, default the last allowed), with one torch thread and the
    workers' GIL switch interval (`services.engine.config.configure_process`)."""
    cpu = sorted(os.sched_getaffinity(0))[-1] if cpu is None else cpu
    code = (
        "import json, sys, argparse\n"
        "from pathlib import Path\n"
        "from services.engine.config import configure_process\n"
        f"configure_process(argparse.Namespace(cpu={cpu}, threads=1))\n"
        "from services.planner.profiler import profile\n"
        "from services.loadgen.fidelity import GRIDS\n"
        f"grid = GRIDS[{grid!r}]\n"
        f"print(json.dumps(profile(Path({str(model_dir)!r}), grid, progress=False)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=900
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class EngineParams:
    """The decode and prefill engines' limits, as the simulator takes them."""

    kv_capacity: int  # tokens of KV in the decode instance's pool
    max_batch_tokens: int
    max_num_seqs: int
    kv_bytes_per_token: int

    @classmethod
    def of(cls, mesh, model_dir: Path) -> EngineParams:
        """From the running decode instance (its KV pool) and the options it was started with."""
        address = next(p.ready["address"] for p in mesh.workers if p.name.startswith("decode"))
        with grpc.insecure_channel(address) as channel:
            stats = decode_pb2_grpc.DecodeStub(channel).Stats(common_pb2.StatsRequest(), timeout=5)
        mc = ModelConfig.from_dir(model_dir)
        return cls(
            kv_capacity=stats.load.total_kv_blocks * BLOCK_SIZE,
            max_batch_tokens=MAX_BATCH_TOKENS,
            max_num_seqs=MAX_NUM_SEQS,
            kv_bytes_per_token=mc.kv_bytes_per_token(4),  # float32 on CPU
        )


@dataclass(frozen=True)
class MeshCalibration:
    """What the mesh costs beyond the engine's steps, measured on it (seconds; bytes/s)."""

    decode_step_extra_s: float  # per decode iteration: the worker's loop and its streaming
    decode_seq_extra_s: float  # per sequence in a decode iteration
    ttft_hops_s: float  # unloaded TTFT beyond the prefill batch (client, gateway, gRPC hops)
    handoff_s: float  # first-to-second token gap beyond one decode step and the KV transfer
    bandwidth: float  # KV pull bandwidth measured by the decode instance (bytes / pull seconds)
    requests: int  # in the calibration run

    def to_json(self) -> dict:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


def run(address: str, requests: Requests, vocab_size: int, seed: int) -> LoadResult:
    """The requests through the gateway's gRPC API, open loop (same seed: same prompts)."""
    return asyncio.run(run_load(GrpcTarget(address), load_requests(requests, vocab_size, seed)))


def warm_up(address: str, vocab_size: int) -> None:
    """A few requests of every size class, so first-call costs stay out of the measurements."""
    lengths = np.array([16, 64, 256, 512, 900] * 3)
    reqs = Requests(np.arange(len(lengths)) * 0.05, lengths, np.full(len(lengths), 8))
    run(address, reqs, vocab_size, seed=12345)


def decode_gap(address: str, vocab_size: int, count: int, prompt: int, output: int) -> float:
    """The mesh's decode iteration (s) as requests see it: `count` requests sent together (more
    than the decode seats: a saturated decode instance streaming at its full token rate, as
    under load), each one's time from its 3rd to its last token over the tokens between (a
    mean, so tokens that arrive several to a message do not bias it; the hand-off gap is left
    out), median over the requests."""
    reqs = Requests(np.zeros(count), np.full(count, prompt), np.full(count, output))
    result = run(address, reqs, vocab_size, seed=777 + count)
    per_request = [np.sum(g[1:]) / (len(g) - 1) for g in result.token_gaps_s]
    return float(np.median(per_request))


def calibrate(
    mesh, latency: LatencyModel, requests: Requests, vocab_size: int, seed: int
) -> MeshCalibration:
    """Measure the mesh beyond the engine (see the module docstring): its decode iteration at
    batch 1 (requests one at a time) and at a full batch (a burst of 4x the seats, so the
    instance streams at its full token rate as under load) against the profile's, then
    `requests` (at a rate where they rarely overlap) for the TTFT beyond prefill and the
    hand-off."""
    lat = latency.at(1)
    prompt, output = 256, 96
    extra = []
    for batch, count in ((1, 1), (MAX_NUM_SEQS, 4 * MAX_NUM_SEQS)):
        gaps = [decode_gap(mesh.gateway_address, vocab_size, count, prompt, output)]
        if count == 1:
            gaps += [
                decode_gap(mesh.gateway_address, vocab_size, 1, prompt, output) for _ in range(3)
            ]
        ctx = batch * (prompt + output // 2)
        extra.append(float(np.median(gaps)) - lat.decode_ms(batch, ctx) / 1000)
    seq_extra = max(0.0, (extra[1] - extra[0]) / max(1, MAX_NUM_SEQS - 1))
    step_extra = max(0.0, extra[0] - seq_extra)
    pulled0 = _pull_totals(mesh)
    result = run(mesh.gateway_address, requests, vocab_size, seed)
    pulled1 = _pull_totals(mesh)
    nbytes, seconds = pulled1[0] - pulled0[0], pulled1[1] - pulled0[1]
    bandwidth = nbytes / seconds if seconds > 0 else 1e9
    ok = result.ok
    p = requests.prompt[ok]
    prefill_s = np.array([lat.prefill_ms(n, n * n) / 1000 for n in p])
    ttft_hops = float(np.median(result.ttft_s[ok] - prefill_s))
    kvb = ModelConfig.from_dir(mesh.spec.model).kv_bytes_per_token(4)
    step = np.array([lat.decode_ms(1, n + 1) / 1000 for n in p]) + step_extra + seq_extra
    second = np.array([g[0] if len(g) else np.nan for g in result.token_gaps_s])[ok]
    handoff = float(np.nanmedian(second - step - p * kvb / bandwidth))
    return MeshCalibration(
        decode_step_extra_s=step_extra,
        decode_seq_extra_s=seq_extra,
        ttft_hops_s=max(0.0, ttft_hops),
        handoff_s=max(0.0, handoff),
        bandwidth=bandwidth,
        requests=int(ok.sum()),
    )


def _pull_totals(mesh) -> tuple[int, float]:
    """(bytes pulled, seconds of pulls) of the decode instance so far."""
    proc = next(p for p in mesh.workers if p.name.startswith("decode"))
    with grpc.insecure_channel(proc.ready["address"]) as channel:
        stats = decode_pb2_grpc.DecodeStub(channel).Stats(common_pb2.StatsRequest(), timeout=5)
    text = urllib.request.urlopen(f"http://{proc.ready['metrics_address']}/metrics").read()
    seconds = 0.0
    for line in text.decode().splitlines():
        if line.startswith("distserve_kv_transfer_seconds_sum"):
            seconds = float(line.split()[-1])
    return stats.pull_bytes_total, seconds


def mesh_latency(latency: LatencyModel, cal: MeshCalibration) -> LatencyModel:
    """The engine profile with the decode worker's own costs per iteration (`a`) and per
    sequence in it (`c`) added, as measured on the mesh."""
    lat = latency.at(1)
    a, c = cal.decode_step_extra_s * 1000, cal.decode_seq_extra_s * 1000
    tp = TpLatency(
        prefill=lat.prefill,
        decode_small=_plus(lat.decode_small, a, c),
        decode_large=_plus(lat.decode_large, a, c),
        threshold=lat.threshold,
    )
    source = f"{latency.source} + mesh decode costs measured on the mesh"
    return replace(latency, by_tp={1: tp}, source=source)


def _plus(k: Coefficients, a: float, c: float) -> Coefficients:
    return Coefficients(k.a + a, k.b, k.c + c)


def predict(
    latency: LatencyModel, cal: MeshCalibration, requests: Requests, params: EngineParams
) -> SimResult:
    """Per-request TTFT and TPOT the simulator predicts for the mesh."""
    model = mesh_latency(latency, cal)
    sim = simulate_1p1d(
        model,
        requests,
        kv_bytes_per_token=params.kv_bytes_per_token,
        kv_capacity=params.kv_capacity,
        max_batch_tokens=params.max_batch_tokens,
        max_num_seqs=params.max_num_seqs,
        bandwidth=cal.bandwidth,
    )
    out = requests.output
    ttft = sim.ttft + cal.ttft_hops_s
    tpot = np.where(out > 1, sim.tpot + cal.handoff_s / np.maximum(out - 1, 1), 0.0)
    return SimResult(ttft, tpot)


# -- the comparison ----------------------------------------------------------------------------

TTFT_SLO_FACTOR = 5.0
TPOT_SLO_FACTOR = 3.0


def slo_rule(
    latency: LatencyModel, cal: MeshCalibration, requests: Requests, params: EngineParams
) -> Slo:
    """SLOs as multiples of the unloaded mesh, predicted: TTFT 5x the median prompt's (prefill
    + hops), TPOT 3x the median request's (one decode step at its context, batch 1, plus its
    share of the hand-off and KV transfer)."""
    lat = mesh_latency(latency, cal).at(1)
    p, o = float(np.median(requests.prompt)), float(np.median(requests.output))
    ttft = lat.prefill_ms(p, p * p) / 1000 + cal.ttft_hops_s
    kvb = params.kv_bytes_per_token
    step = lat.decode_ms(1, p + o / 2) / 1000
    tpot = step + (cal.handoff_s + p * kvb / cal.bandwidth) / max(1.0, o - 1)
    return Slo(TTFT_SLO_FACTOR * ttft, TPOT_SLO_FACTOR * tpot)


def choose_rates(
    latency: LatencyModel,
    cal: MeshCalibration,
    base: Requests,
    params: EngineParams,
    slo: Slo,
    targets: tuple[float, ...],
) -> list[float]:
    """For each target attainment, the rate at which the simulator predicts it (bisection on
    the rate of `base`, which is sampled at 1 request/s): the rates come from the model alone,
    never from measurements of the mesh."""
    rates = []
    for target in targets:
        lo, hi = 0.1, 200.0
        for _ in range(30):
            mid = (lo * hi) ** 0.5
            if predict(latency, cal, base.at_rate(mid), params).attainment(slo) >= target:
                lo = mid
            else:
                hi = mid
        rates.append(round(lo, 2))
    return rates


@dataclass(frozen=True)
class FidelityRow:
    """One rate: attainment the simulator predicted and the mesh measured."""

    rate: float
    predicted: float
    measured: float
    errors: int  # requests that failed on the mesh
    send_lag_max_ms: float

    @property
    def gap_pp(self) -> float:
        return abs(self.predicted - self.measured) * 100


def compare(
    mesh,
    latency: LatencyModel,
    cal: MeshCalibration,
    base: Requests,
    params: EngineParams,
    slo: Slo,
    rates: list[float],
    vocab_size: int,
    seed: int,
) -> list[FidelityRow]:
    """The same seeded requests at each rate through the simulator and through the mesh."""
    rows = []
    for rate in rates:
        requests = base.at_rate(rate)
        predicted = predict(latency, cal, requests, params).attainment(slo)
        result = run(mesh.gateway_address, requests, vocab_size, seed)
        rows.append(
            FidelityRow(
                rate=rate,
                predicted=predicted,
                measured=result.attainment(slo),
                errors=int((~result.ok).sum()),
                send_lag_max_ms=float(np.nanmax(result.send_lag_s)) * 1000,
            )
        )
    return rows


@dataclass(frozen=True)
class Fidelity:
    """One comparison: the SLOs, what the mesh costs beyond the engine, and one row per rate."""

    slo: Slo
    calibration: MeshCalibration
    params: EngineParams
    rows: list[FidelityRow]

    @property
    def max_gap_pp(self) -> float:
        return max(r.gap_pp for r in self.rows)

    def to_json(self) -> dict:
        return {
            "slo_ms": [round(self.slo.ttft_s * 1000, 3), round(self.slo.tpot_s * 1000, 3)],
            "calibration": self.calibration.to_json(),
            "engine": {
                "kv_capacity_tokens": self.params.kv_capacity,
                "max_batch_tokens": self.params.max_batch_tokens,
                "max_num_seqs": self.params.max_num_seqs,
            },
            "rows": [
                {
                    "rate_rps": r.rate,
                    "predicted": round(r.predicted, 4),
                    "measured": round(r.measured, 4),
                    "gap_pp": round(r.gap_pp, 2),
                    "errors": r.errors,
                    "send_lag_max_ms": round(r.send_lag_max_ms, 2),
                }
                for r in self.rows
            ],
            "max_gap_pp": round(self.max_gap_pp, 2),
        }


def measure(
    model_dir: Path,
    grid: str,
    targets: tuple[float, ...],
    requests: int,
    calibration_requests: int = 60,
    seed: int = 7,
) -> Fidelity:
    """The whole comparison on `model_dir`: profile it pinned (`grid`), start a pinned 1P1D
    mesh, calibrate it, derive the SLOs, pick the rates at which the simulator predicts each
    target attainment, and run the same `requests` seeded requests at each rate through both."""
    from services.launcher import Mesh, MeshSpec
    from services.planner.latency import load

    profile = profile_pinned(model_dir, grid)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        path.write_text(json.dumps(profile))
        latency = load(path)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    mesh = Mesh(MeshSpec(model_dir, gateway_port=0, worker_args=WORKER_ARGS, pin=True))
    try:
        mesh.start()
        params = EngineParams.of(mesh, model_dir)
        warm_up(mesh.gateway_address, vocab)
        cal_requests = WORKLOAD.sample(calibration_requests, seed=99).at_rate(6.0)
        cal = calibrate(mesh, latency, cal_requests, vocab, seed=99)
        base = WORKLOAD.sample(requests, seed=seed)
        slo = slo_rule(latency, cal, base, params)
        rates = choose_rates(latency, cal, base, params, slo, targets)
        rows = compare(mesh, latency, cal, base, params, slo, rates, vocab, seed=seed)
    finally:
        mesh.stop()
    return Fidelity(slo, cal, params, rows)
