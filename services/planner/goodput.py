"""Goodput: the highest request rate at which a fraction alpha of requests meet both SLOs.

Found by bisection over the rate on the simulator. The requests are sampled once at unit rate
and rescaled (`Requests.at_rate`), so every rate sees the same prompts, outputs and arrival
pattern and attainment falls with the rate without sampling noise between the probes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from services.common.latency import LatencyModel
from services.common.slo import Slo
from services.planner.simulator import Instance, SimCluster, simulate
from services.planner.workload import Requests, TraceWorkload, Workload

REL_TOL = 0.02  # bisection stops when the bracket is within 2% of its upper end


def max_rate(
    attainment_at: Callable[[float], float],
    alpha: float,
    hint: float,
    rel_tol: float = REL_TOL,
) -> float:
    """The highest rate r with attainment_at(r) >= alpha, to rel_tol; 0 if none above hint/1e4.

    Starts at `hint`, doubles or halves until the answer is bracketed, then bisects.
    """
    lo, hi = 0.0, math.inf
    rate = hint
    floor = hint * 1e-4
    while True:
        if attainment_at(rate) >= alpha:
            lo = rate
        else:
            hi = rate
        if hi == math.inf:
            rate = lo * 2
        elif lo == 0.0:
            if hi < floor:
                return 0.0
            rate = hi / 2
        elif hi - lo <= rel_tol * hi:
            return lo
        else:
            rate = (lo + hi) / 2


def goodput(
    cluster: SimCluster,
    workload: Workload | TraceWorkload,
    slo: Slo,
    alpha: float,
    *,
    min_requests: int = 1000,
    seed: int = 0,
    hint: float | None = None,
    rel_tol: float = REL_TOL,
) -> float:
    """Goodput of the cluster on the workload, in requests per second.

    Each probe simulates n requests and judges the middle half: the first quarter fills the
    cluster (warm-up), the last quarter keeps it loaded until the judged ones finish. n is at
    least 8x the requests the cluster can hold at once, so both quarters cover its batches.
    """
    requests = workload.sample(min_requests, seed)
    n = max(min_requests, 8 * concurrency(cluster, requests))
    if n > min_requests:
        requests = workload.sample(n, seed)
    warm, until = n // 4, n - n // 4

    def attainment(rate: float) -> float:
        return simulate(cluster, requests.at_rate(rate), until).attainment(slo, warm)

    return max_rate(attainment, alpha, hint or capacity_hint(cluster, requests), rel_tol)


def concurrency(cluster: SimCluster, requests: Requests) -> int:
    """How many requests the cluster's decode batches hold at most (memory and seats)."""
    need = float((requests.prompt + requests.output).mean())
    return sum(
        inst.pp * max(1, min(inst.max_num_seqs // inst.pp, int(inst.kv_capacity / inst.pp / need)))
        for inst in cluster.instances
        if inst.role != "prefill"
    )


def capacity(inst: Instance, latency: LatencyModel, requests: Requests) -> float:
    """An upper bound on the requests per second one instance can serve: the least of its
    phases' throughputs at full utilisation, prefill in batches of L_m tokens (or one prompt)
    and decode in the largest batch its memory and seats allow. From mean lengths, so a bound
    in spirit: callers leave some slack."""
    lat = latency.at(inst.tp)
    prompt = float(requests.prompt.mean())
    square = float((requests.prompt.astype(float) ** 2).mean())
    output = float(requests.output.mean())
    rates = []
    if inst.role in ("prefill", "colocated"):
        k = max(1.0, inst.max_batch_tokens // prompt)  # prompts per batch
        stage = lat.prefill_ms(k * prompt, k * square) / inst.pp + latency.stage_overhead_ms
        rates.append(1000 * k / stage)  # a batch enters the pipeline every stage time
    if inst.role in ("decode", "colocated") and output > 1:
        # pp lanes, each with 1/pp of the seats and memory, each stepping the whole model
        seats, room = inst.max_num_seqs // inst.pp, inst.kv_capacity // inst.pp
        batch = max(1, min(seats, int(room // (prompt + output))))
        step = lat.decode_ms(batch, batch * (prompt + output / 2))
        rates.append(1000 * inst.pp * batch / (step * (output - 1)))
    return min(rates) if rates else math.inf


def capacity_hint(cluster: SimCluster, requests: Requests) -> float:
    """The bisection's first probe: the least of the phases' summed capacities."""
    prefill = decode = 0.0
    for inst in cluster.instances:
        lat = cluster.latency
        if inst.role == "colocated" and cluster.colocated_latency is not None:
            lat = cluster.colocated_latency
        rate = capacity(inst, lat, requests)
        if inst.role != "decode":
            prefill += rate
        if inst.role != "prefill":
            decode += rate
    rates = [r for r in (prefill, decode) if 0 < r < math.inf]
    return min(rates) if rates else 1.0
