"""Simulator fidelity: the planner's simulator, fed this machine's profile, against the real mesh.

The engine profile (`services.planner.profiler`, run pinned to one core with one torch thread,
as a `--pin` worker runs) times the engine's steps alone; a worker of the mesh does more on its
core, and on a 2-core machine the unpinned gateway and load generator share the same cores. So
the comparison runs on a model whose engine steps outweigh that (`MODEL`), with the gateway's
admission off (the simulator models queues, not refusals), and adds what the mesh costs beyond
the engine, measured on the mesh itself (`distserve.loadgen.calibration`): unloaded, then how
much slower each phase runs in a saturating burst (`BURST` requests at once). The SLOs come
from the unloaded figures.

Then `simulate_1p1d` runs with the workers' real engine parameters (L_m, max_num_seqs, KV
capacity in tokens from the running decode instance) and the gateway's layer-wise handoff rule
on the same seeded requests as the mesh, at the rates where it predicts each target attainment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from distserve.loadgen.calibration import (
    MeshCalibration,
    after_prefill,
    calibrate,
    mesh_latency,
    one_at_a_time,
    run,
    under_load,
    warm_up,
)
from distserve.loadgen.comparison import ADMISSION_OFF
from distserve.loadgen.results import LoadResult
from services.common.gen.distserve.v1 import common_pb2, decode_pb2_grpc
from services.common.latency import LatencyModel
from services.common.model_config import ModelConfig
from services.common.slo import Slo
from services.common.stats import percentile
from services.engine.presets import create_model
from services.planner.profiler import QUICK, ProfileGrid, _compositions
from services.planner.simulator import SimResult, simulate_1p1d
from services.planner.workload import LengthDist, Requests, Workload

# Prompts of 64..768 tokens (prefill a few ms), outputs of 32..160: with two decode seats the
# decode instance's seats bind at rates where the two cores still have room for the gateway and
# the load generator (the tiny model's per-token service costs otherwise saturate them first).
WORKLOAD = Workload(
    "fidelity", LengthDist("uniform", low=64, high=768), LengthDist("uniform", low=32, high=160)
)
# The model of the comparison: the `tiny` preset's architecture and tokenizer, wider and deeper
# (about 11M parameters besides the embeddings) so that an engine step outweighs what the mesh
# does per token beyond it: on the `tiny` preset a decode step is ~0.3 ms and the per-token gRPC
# streaming through the gateway to the client costs about as much again, on the same two cores.
MODEL = {
    "hidden_size": 384,
    "intermediate_size": 1536,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
}
BLOCK_SIZE = 16
# The engine options of every worker in the comparison: the simulator gets the same ones.
MAX_BATCH_TOKENS = 1024
MAX_NUM_SEQS = 2
KV_TOKENS = 32768  # the KV pool of each worker, in tokens
# Prompts of at least this many tokens hand their KV off beside their prefill (the gateway's
# `--layerwise-min-tokens`, set explicitly here; the simulator gets the same rule).
LAYERWISE_MIN_TOKENS = 256


def create(path: Path) -> Path:
    """The comparison's model (`MODEL`), written to `path`."""
    return create_model("tiny", path, **MODEL)


def worker_args(model_dir: Path) -> tuple[str, ...]:
    """The workers' engine options: a KV pool of `KV_TOKENS` tokens for this model, the batch
    limits above."""
    kv_mb = -(-KV_TOKENS * ModelConfig.from_dir(model_dir).kv_bytes_per_token(4) // 2**20)
    return (
        "--kv-cache-gib",
        str(kv_mb / 1024),
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
        f"configure_process(argparse.Namespace(cpu={cpu}, threads=1, engine='torch'))\n"
        "from services.planner.profiler import profile\n"
        "from distserve.loadgen.fidelity import GRIDS\n"
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
        layerwise_min_tokens=LAYERWISE_MIN_TOKENS,
        handoff_s=cal.handoff_s,
        layerwise_prefill_s=cal.layerwise_prefill_s,
    )
    return SimResult(sim.ttft + cal.ttft_hops_s, sim.tpot)


# -- the comparison ----------------------------------------------------------------------------

# Requests of the burst that measures how much slower each phase runs under load.
BURST = 24
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
    prefill = lat.prefill_ms(p, p * p) / 1000
    ttft = (
        prefill + cal.ttft_hops_s + (cal.layerwise_prefill_s if p >= LAYERWISE_MIN_TOKENS else 0.0)
    )
    after = float(
        after_prefill(p, prefill, params.kv_bytes_per_token, cal.bandwidth, LAYERWISE_MIN_TOKENS)
    )
    step = lat.decode_ms(1, p + o / 2) / 1000
    tpot = step + (cal.handoff_s + after) / max(1.0, o - 1)
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
    """One rate: attainment the simulator predicted and the mesh measured in each of its runs
    (the same requests each time), and, per run, to see which side of the SLO a gap comes from,
    each SLO alone and the p50 / p90 of TTFT and TPOT (ms)."""

    rate: float
    predicted: float
    measured_runs: tuple[float, ...]
    errors: int  # requests that failed on the mesh, all runs
    send_lag_max_ms: float
    details: tuple[dict, ...]

    @property
    def measured(self) -> float:
        return float(np.mean(self.measured_runs))

    @property
    def gap_pp(self) -> float:
        """Between the prediction and the mean of the mesh's runs."""
        return abs(self.predicted - self.measured) * 100

    @property
    def spread_pp(self) -> float:
        """Between the mesh's own runs of the same requests: how far it repeats itself."""
        return (max(self.measured_runs) - min(self.measured_runs)) * 100


def _detail(sim: SimResult, mesh: LoadResult, slo: Slo) -> dict:
    """Per SLO: the fraction meeting it and the p50 / p90, predicted and measured."""
    ok = mesh.ok
    out = {}
    for name, bound, pred, meas in (
        ("ttft", slo.ttft_s, sim.ttft, mesh.ttft_s),
        ("tpot", slo.tpot_s, sim.tpot, mesh.tpot_s),
    ):
        met = ok & (np.nan_to_num(meas, nan=np.inf) <= bound)  # a failure misses both
        out[name] = {
            "met_predicted": round(float(np.mean(pred <= bound)), 4),
            "met_measured": round(float(np.mean(met)), 4),
            **{
                f"p{q}_ms_{side}": round(percentile(v, q) * 1000, 2) if len(v) else None
                for side, v in (("predicted", pred), ("measured", meas[ok]))
                for q in (50, 90)
            },
        }
    return out


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
    repeats: int = 1,
) -> list[FidelityRow]:
    """The same seeded requests (lengths, arrivals) at each rate through the simulator and,
    `repeats` times, through
    the mesh: near the knee of the attainment curve the mesh's own runs of the same arrivals
    can differ by more than any gap worth measuring, and only repeats show it."""
    rows = []
    for i, rate in enumerate(rates):
        requests = base.at_rate(rate)
        sim = predict(latency, cal, requests, params)
        # The same lengths and arrivals each time, with prompts of their own: a prompt sent
        # again would find its KV in the prefix caches, which the simulator does not model.
        results = [
            run(mesh.gateway_address, requests, vocab_size, (seed, i, k)) for k in range(repeats)
        ]
        rows.append(
            FidelityRow(
                rate=rate,
                predicted=sim.attainment(slo),
                measured_runs=tuple(r.attainment(slo) for r in results),
                errors=sum(int((~r.ok).sum()) for r in results),
                send_lag_max_ms=max(float(np.nanmax(r.send_lag_s)) for r in results) * 1000,
                details=tuple(_detail(sim, r, slo) for r in results),
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

    @property
    def max_spread_pp(self) -> float:
        return max(r.spread_pp for r in self.rows)

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
                    "measured_runs": [round(m, 4) for m in r.measured_runs],
                    "gap_pp": round(r.gap_pp, 2),
                    "spread_pp": round(r.spread_pp, 2),
                    "errors": r.errors,
                    "send_lag_max_ms": round(r.send_lag_max_ms, 2),
                    "runs": list(r.details),
                }
                for r in self.rows
            ],
            "max_gap_pp": round(self.max_gap_pp, 2),
            "max_spread_pp": round(self.max_spread_pp, 2),
        }


def measure(
    model_dir: Path,
    grid: str,
    targets: tuple[float, ...],
    requests: int,
    calibration_requests: int = 60,
    seed: int = 7,
    repeats: int = 1,
) -> Fidelity:
    """The whole comparison on `model_dir`: profile it pinned (`grid`), start a pinned 1P1D
    mesh, calibrate it, derive the SLOs, pick the rates at which the simulator predicts each
    target attainment, and run the same `requests` seeded requests at each rate through both
    (through the mesh `repeats` times)."""
    from distserve.local_mesh import Mesh, MeshSpec
    from services.common.latency import load

    profile = profile_pinned(model_dir, grid)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "profile.json"
        path.write_text(json.dumps(profile))
        latency = load(path)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    # Admission off: the simulator models queues, not refusals or prompts held at the gateway.
    spec = MeshSpec(
        model_dir,
        gateway_port=0,
        worker_args=worker_args(model_dir),
        gateway_args=(*ADMISSION_OFF, "--layerwise-min-tokens", str(LAYERWISE_MIN_TOKENS)),
        pin=True,
    )
    mesh = Mesh(spec)
    try:
        mesh.start()
        params = EngineParams.of(mesh, model_dir)
        warm_up(mesh.gateway_address, vocab)
        cal_requests = one_at_a_time(latency, WORKLOAD.sample(calibration_requests, seed=99))
        cal = calibrate(
            mesh,
            latency,
            cal_requests,
            vocab,
            seed=99,
            seats=MAX_NUM_SEQS,
            layerwise_min=LAYERWISE_MIN_TOKENS,
        )
        sampled = WORKLOAD.sample(BURST, seed=55)
        burst = Requests(np.zeros(BURST), sampled.prompt, sampled.output)
        loaded = run(mesh.gateway_address, burst, vocab, seed=55)
        base = WORKLOAD.sample(requests, seed=seed)
        slo = slo_rule(latency, cal, base, params)  # multiples of the unloaded mesh
        cal = under_load(
            cal, latency, burst, loaded, lambda c: predict(latency, c, burst, params), MAX_NUM_SEQS
        )
        rates = choose_rates(latency, cal, base, params, slo, targets)
        rows = compare(
            mesh, latency, cal, base, params, slo, rates, vocab, seed=seed, repeats=repeats
        )
    finally:
        mesh.stop()
    return Fidelity(slo, cal, params, rows)
