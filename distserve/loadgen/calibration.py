"""What a 1P1D mesh costs beyond its engine's steps, measured on the mesh (`calibrate`).

The engine profile times prefill and decode steps alone. A worker does more: it streams one gRPC
message per decode token, serves and pulls KV, and on a small host shares its cores with the
gateway and the load generator. `calibrate` measures, on a running mesh:

* the decode iteration as requests see it, alone and in a full batch, at contexts across the
  workload's: what exceeds the profile goes into the decode fixed cost `a` and per-sequence
  cost `c` (`decode_extras`, `mesh_latency`);
* unloaded requests (`one_at_a_time`): the TTFT beyond the prefill, as latency on every prompt
  (`ttft_hops_s`: client, gateway, gRPC hops) plus, for prompts whose KV is pulled beside their
  prefill, prefill time (`layerwise_prefill_s`: the prefill instance serving the pull);
* the KV pull bandwidth, from pulls after prefill only (a pull beside a prefill lasts as long as
  the prefill), and the rest of the first-to-second token gap beyond one decode step and the
  transfer left after prefill (`handoff_s`: pull set-up, the join).

On a 2-core host the workers' steps are slower under load than alone (the unpinned gateway and
load generator take more of both cores as the rate rises, and each worker's own serving work
grows with it), which the measurements above, all taken on an unloaded mesh, cannot see: a
saturating burst measures it (`under_load`), as a factor on each phase's step time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import grpc
import numpy as np

from distserve.loadgen.requests import load_requests
from distserve.loadgen.results import LoadResult
from distserve.loadgen.runner import run_load
from distserve.loadgen.targets import GrpcTarget
from services.common.gen.distserve.v1 import common_pb2, decode_pb2_grpc
from services.common.latency import Coefficients, LatencyModel, TpLatency
from services.common.model_config import ModelConfig
from services.common.stats import percentile
from services.planner.simulator import SimResult
from services.planner.workload import Requests


@dataclass(frozen=True)
class MeshCalibration:
    """What the mesh costs beyond the engine's steps, measured on it (seconds; bytes/s)."""

    decode_step_extra_s: float  # per decode iteration: the worker's loop and its streaming
    decode_seq_extra_s: float  # per sequence in a decode iteration
    ttft_hops_s: float  # unloaded TTFT beyond the prefill batch (client, gateway, gRPC hops)
    layerwise_prefill_s: float  # prefill time added by serving a prompt's KV beside its prefill
    handoff_s: float  # first-to-second token gap beyond one decode step and the KV transfer
    bandwidth: float  # KV pull bandwidth (bytes / seconds of pulls after prefill)
    requests: int  # in the calibration run
    prefill_scale: float = 1.0  # prefill step time under load over unloaded (`under_load`)
    decode_scale: float = 1.0  # decode step time under load over unloaded

    def to_json(self) -> dict:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}


def run(
    address: str, requests: Requests, vocab_size: int, seed: int | tuple[int, ...]
) -> LoadResult:
    """The requests through the gateway's gRPC API, open loop (same seed: same prompts)."""
    return asyncio.run(run_load(GrpcTarget(address), load_requests(requests, vocab_size, seed)))


def warm_up(address: str, vocab_size: int) -> None:
    """A few requests of every size class, so first-call costs stay out of the measurements."""
    lengths = np.array([16, 64, 256, 512, 900] * 3)
    reqs = Requests(np.arange(len(lengths)) * 0.05, lengths, np.full(len(lengths), 8))
    run(address, reqs, vocab_size, seed=12345)


def steady_gaps(result: LoadResult, prompts) -> list[tuple[float, int]]:
    """Per successful request with enough tokens: its mean token gap over the middle half of its
    tokens (several tokens to a message do not bias a mean; the hand-off gap and a burst's joins
    stay out) and its context at the middle of that stretch."""
    out = []
    for ok, prompt, g in zip(result.ok, prompts, result.token_gaps_s, strict=True):
        lo, hi = len(g) // 4, 3 * len(g) // 4
        if ok and hi - lo >= 4:
            out.append((float(np.mean(g[lo:hi])), int(prompt) + 1 + (lo + hi) // 2))
    return out


def decode_extras(
    address: str,
    latency: LatencyModel,
    vocab_size: int,
    seats: int,
    prompts: tuple[int, ...],
    output: int = 96,
    reps: int = 2,
) -> tuple[float, float]:
    """What the mesh's decode iteration takes beyond the profile's (seconds): per iteration and
    per sequence in it. At each of `prompts` (`reps` times): one request alone (batch 1) and a
    burst of `seats` requests sent together (the batch full once the last has joined). Per
    request, its steady gap (`steady_gaps`) less the profile's step at that batch and context;
    the per-batch medians give the two costs. Several contexts and repeats,
    because at the knee of the attainment curve a millisecond of decode step moves the decode
    queue a lot, and one context measured once moved these by that much between runs."""
    lat = latency.at(1)
    residuals: dict[int, list[float]] = {1: [], seats: []}
    for r in range(reps):
        for prompt in prompts:
            for batch in (1, seats):
                reqs = Requests(np.zeros(batch), np.full(batch, prompt), np.full(batch, output))
                result = run(address, reqs, vocab_size, seed=777 + 1009 * r + 31 * prompt + batch)
                for gap, ctx in steady_gaps(result, reqs.prompt):
                    residuals[batch].append(gap - lat.decode_ms(batch, batch * ctx) / 1000)
    one, full = (float(np.median(residuals[b])) for b in (1, seats))
    per_seq = max(0.0, (full - one) / max(1, seats - 1))
    return max(0.0, one - per_seq), per_seq


def calibrate(
    mesh,
    latency: LatencyModel,
    requests: Requests,
    vocab_size: int,
    seed: int,
    *,
    seats: int,
    layerwise_min: int,
) -> MeshCalibration:
    """Measure the mesh beyond the engine: its decode iteration alone and in a full batch at
    the low, middle and high prompt length of `requests` (`decode_extras`); then `requests`,
    spaced so they do not overlap (`one_at_a_time`): first those whose KV is pulled after their
    prefill (the pull bandwidth, from the decode instance's counters), then those pulled beside
    it; from both, the TTFT beyond the prefill and the hand-off."""
    lat = latency.at(1)
    lengths = tuple(int(percentile(requests.prompt, q)) for q in (10, 50, 90))
    step_extra, seq_extra = decode_extras(mesh.gateway_address, latency, vocab_size, seats, lengths)
    late = requests.prompt < layerwise_min
    parts = []
    bandwidth = 1e9
    for mask in (late, ~late):
        part = Requests(
            requests.arrival_s[mask] - requests.arrival_s[mask][0],
            requests.prompt[mask],
            requests.output[mask],
        )
        pulled0 = _pull_totals(mesh)
        result = run(mesh.gateway_address, part, vocab_size, (seed, len(parts)))
        pulled1 = _pull_totals(mesh)
        if mask is late:
            nbytes, seconds = pulled1[0] - pulled0[0], pulled1[1] - pulled0[1]
            bandwidth = nbytes / seconds if seconds > 0 else bandwidth
        parts.append((part, result))
    kvb = ModelConfig.from_dir(mesh.spec.model).kv_bytes_per_token(4)
    ttft_extra, handoff = [], []
    for part, result in parts:
        ok = result.ok
        p = part.prompt[ok]
        prefill_s = np.array([lat.prefill_ms(n, n * n) / 1000 for n in p])
        ttft_extra.append(result.ttft_s[ok] - prefill_s)
        step = np.array([lat.decode_ms(1, n + 1) / 1000 for n in p]) + step_extra + seq_extra
        second = np.array([g[0] if len(g) else np.nan for g in result.token_gaps_s])[ok]
        handoff.append(second - step - after_prefill(p, prefill_s, kvb, bandwidth, layerwise_min))
    # TTFT beyond the prefill: hops for every prompt, plus, for those whose KV the prefill
    # instance serves while it computes, the time that takes it (the two groups' medians)
    hops = max(0.0, float(np.median(ttft_extra[0])))
    return MeshCalibration(
        decode_step_extra_s=step_extra,
        decode_seq_extra_s=seq_extra,
        ttft_hops_s=hops,
        layerwise_prefill_s=max(0.0, float(np.median(ttft_extra[1])) - hops),
        handoff_s=max(0.0, float(np.nanmedian(np.concatenate(handoff)))),
        bandwidth=bandwidth,
        requests=sum(len(h) for h in handoff),
    )


def after_prefill(
    prompt, prefill_s, kv_bytes_per_token: int, bandwidth: float, layerwise_min: int
) -> np.ndarray:
    """Seconds of KV transfer left once the prefill ends: all of it for a prompt pulled after
    its prefill, what outlasts the prefill for one pulled beside it (`layerwise_min` tokens
    and more; the simulator's rule)."""
    prompt = np.asarray(prompt)
    transfer = prompt * kv_bytes_per_token / bandwidth
    beside = np.maximum(0.0, transfer - np.asarray(prefill_s))
    return np.where(prompt >= layerwise_min, beside, transfer)


def one_at_a_time(latency: LatencyModel, requests: Requests, margin: float = 1.5) -> Requests:
    """`requests` spaced so they do not overlap: each arrives `margin` times the previous one's
    unloaded engine time (its prefill and its decode steps at batch 1, from the profile) after
    it, so the calibration sees the mesh unloaded whatever the model's speed."""
    lat = latency.at(1)
    busy = [
        lat.prefill_ms(p, p * p) / 1000 + sum(lat.decode_ms(1, p + k) for k in range(1, o)) / 1000
        for p, o in zip(requests.prompt.tolist(), requests.output.tolist(), strict=True)
    ]
    arrival = np.concatenate(([0.0], np.cumsum(np.array(busy[:-1]) * margin)))
    return Requests(arrival, requests.prompt, requests.output)


def _pull_totals(mesh) -> tuple[int, float]:
    """(bytes pulled, seconds of pulls) of the decode instance so far."""
    proc = next(p for p in mesh.workers if p.name.startswith("decode"))
    with grpc.insecure_channel(proc.ready["address"]) as channel:
        stats = decode_pb2_grpc.DecodeStub(channel).Stats(common_pb2.StatsRequest(), timeout=5)
    seconds = sum(s.value for s in proc.metrics() if s.name == "distserve_kv_transfer_seconds_sum")
    return stats.pull_bytes_total, seconds


def mesh_latency(latency: LatencyModel, cal: MeshCalibration) -> LatencyModel:
    """The engine profile with the decode worker's own costs per iteration (`a`) and per
    sequence in it (`c`) added, as measured on the mesh, and each phase's steps scaled by how
    much slower they run under load."""
    lat = latency.at(1)
    a, c = cal.decode_step_extra_s * 1000, cal.decode_seq_extra_s * 1000
    tp = TpLatency(
        prefill=_scaled(lat.prefill, cal.prefill_scale),
        decode_small=_scaled(_plus(lat.decode_small, a, c), cal.decode_scale),
        decode_large=_scaled(_plus(lat.decode_large, a, c), cal.decode_scale),
        threshold=lat.threshold,
    )
    source = f"{latency.source} + mesh costs measured on the mesh"
    return replace(latency, by_tp={1: tp}, source=source)


def under_load(
    cal: MeshCalibration,
    latency: LatencyModel,
    burst: Requests,
    measured: LoadResult,
    predict: Callable[[MeshCalibration], SimResult],
    seats: int,
) -> MeshCalibration:
    """`cal` with each phase's slow-down under load, from a `burst` (every request sent at once,
    many more than the decode seats: the prefill queue full and the decode batch full for most
    of it) run through the mesh (`measured`) and through the simulator (`predict(cal)`).
    Prefill: the time until the last first token (less the hops) over the predicted one.
    Decode: the median over requests of the steady gap (`steady_gaps`: the batch full then) over
    the model's step at a full batch and that context."""
    ok = measured.ok
    hops = cal.ttft_hops_s
    predicted = predict(cal)
    prefill = (np.max(measured.ttft_s[ok]) - hops) / (np.max(predicted.ttft[ok]) - hops)
    lat = mesh_latency(latency, cal).at(1)
    ratios = [
        gap / (lat.decode_ms(seats, seats * ctx) / 1000)
        for gap, ctx in steady_gaps(measured, burst.prompt)
    ]
    return replace(
        cal,
        prefill_scale=cal.prefill_scale * float(prefill),
        decode_scale=cal.decode_scale * float(np.median(ratios)),
    )


def _plus(k: Coefficients, a: float, c: float) -> Coefficients:
    return Coefficients(k.a + a, k.b, k.c + c)


def _scaled(k: Coefficients, f: float) -> Coefficients:
    return Coefficients(k.a * f, k.b * f, k.c * f)
