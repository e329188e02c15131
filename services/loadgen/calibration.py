"""What a 1P1D mesh costs beyond its engine's steps, measured on the mesh (`calibrate`).

The engine profile times prefill and decode steps alone. A worker does more: it streams one gRPC
message per decode token, serves and pulls KV, and on a small host shares its cores with the
gateway and the load generator. `calibrate` measures, on a running mesh:

* the decode iteration as requests see it, at batch 1 and at a full batch: what exceeds the
  profile goes into the decode fixed cost `a` and per-sequence cost `c` (`mesh_latency`);
* unloaded requests (`one_at_a_time`): the TTFT beyond the prefill, as latency on every prompt
  (`ttft_hops_s`: client, gateway, gRPC hops) plus, for prompts whose KV is pulled beside their
  prefill, prefill time (`early_prefill_s`: the prefill instance serving the pull);
* the KV pull bandwidth, from pulls after prefill only (a pull beside a prefill lasts as long as
  the prefill), and the rest of the first-to-second token gap beyond one decode step and the
  transfer left after prefill (`handoff_s`: pull set-up, the join).
"""

from __future__ import annotations

import asyncio
import urllib.request
from dataclasses import asdict, dataclass, replace

import grpc
import numpy as np

from services.common.gen.distserve.v1 import common_pb2, decode_pb2_grpc
from services.common.model_config import ModelConfig
from services.loadgen.requests import load_requests
from services.loadgen.results import LoadResult
from services.loadgen.runner import run_load
from services.loadgen.targets import GrpcTarget
from services.planner.latency import Coefficients, LatencyModel, TpLatency
from services.planner.workload import Requests


@dataclass(frozen=True)
class MeshCalibration:
    """What the mesh costs beyond the engine's steps, measured on it (seconds; bytes/s)."""

    decode_step_extra_s: float  # per decode iteration: the worker's loop and its streaming
    decode_seq_extra_s: float  # per sequence in a decode iteration
    ttft_hops_s: float  # unloaded TTFT beyond the prefill batch (client, gateway, gRPC hops)
    early_prefill_s: float  # prefill time added by serving a prompt's KV beside its prefill
    handoff_s: float  # first-to-second token gap beyond one decode step and the KV transfer
    bandwidth: float  # KV pull bandwidth (bytes / seconds of pulls after prefill)
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
    mesh,
    latency: LatencyModel,
    requests: Requests,
    vocab_size: int,
    seed: int,
    *,
    seats: int,
    layerwise_min: int,
) -> MeshCalibration:
    """Measure the mesh beyond the engine: its decode iteration at batch 1 (requests one at a
    time) and at a full batch (a burst of 4x the decode `seats`, so the
    instance streams at its full token rate as under load) against the profile's; then
    `requests`, spaced so they do not overlap (`one_at_a_time`): first those whose KV is pulled
    after their prefill (the pull bandwidth, from the decode instance's counters), then those
    pulled beside it; from both, the TTFT beyond the prefill and the hand-off."""
    lat = latency.at(1)
    prompt, output = 256, 96
    extra = []
    for batch, count in ((1, 1), (seats, 4 * seats)):
        gaps = [decode_gap(mesh.gateway_address, vocab_size, count, prompt, output)]
        if count == 1:
            gaps += [
                decode_gap(mesh.gateway_address, vocab_size, 1, prompt, output) for _ in range(3)
            ]
        ctx = batch * (prompt + output // 2)
        extra.append(float(np.median(gaps)) - lat.decode_ms(batch, ctx) / 1000)
    seq_extra = max(0.0, (extra[1] - extra[0]) / max(1, seats - 1))
    step_extra = max(0.0, extra[0] - seq_extra)
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
        result = run(mesh.gateway_address, part, vocab_size, seed)
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
        early_prefill_s=max(0.0, float(np.median(ttft_extra[1])) - hops),
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
