"""Goodput: the highest request rate at which a fraction alpha of requests meet both SLOs.

Found on the simulator in two steps, each an estimate with a 95% interval and the number of
simulated requests behind it (`GoodputEstimate`, services/planner/estimate.py):

1. `goodput`, the search's quick estimate: one sample of requests (at least `min_requests`,
   and 8x what the cluster holds at once) drawn once at unit rate and rescaled to every probed
   rate, so probes and candidates compare on the same draws (common random numbers). `bracket`
   finds the rate where attainment crosses alpha to 2%, in few probes: it aims each probe at the
   interpolated crossing and straddles it. The search compares candidates on these.
2. `refine`, for the placements a plan reports: the run is lengthened to as many judged
   requests as the quick estimate's interval says the precision needs (its width falls as
   1/sqrt(n)), and the crossing found again near the last one, until the interval is within the
   precision or the budget of simulated requests is spent (the interval printed says which).

The spread of a short estimate comes from the queueing itself: at the goodput, whether a tenth
of the requests miss hangs on a few bursts of arrivals, so only more judged requests narrow it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from services.common.errors import InvalidRequest
from services.common.latency import LatencyModel
from services.common.slo import Slo
from services.planner.estimate import Crossing, GoodputEstimate
from services.planner.simulator import Instance, SimCluster
from services.planner.workload import Requests, TraceWorkload, Workload

REL_TOL = 0.02  # the search's bracket ends within 2% of each other
FIRST_GROWTH = 16  # the first longer run judges at most this many times the quick estimate's
MARGIN = 1.3  # a longer run judges this many times what the last interval says it needs
PROBES_PER_REFINE = 2.5  # probes one refinement step takes, for its budget


def bracket(
    attainment_at: Callable[[float], float],
    alpha: float,
    hint: float,
    rel_tol: float = REL_TOL,
) -> tuple[float, float]:
    """(lo, hi): attainment_at(lo) >= alpha > attainment_at(hi), hi - lo <= rel_tol * hi;
    (0, hi) if nothing down to hint/1e4 meets alpha.

    From `hint` (usually within some 10% of the answer), steps up or down by 1.25x, then by the
    square of the last step, until the crossing is bracketed; after three steps down it tries
    hint/1e4 at once, so a configuration that never meets the SLO costs five probes. Inside the
    bracket: bisection while an end's attainment is saturated (1 or 0, which says nothing of
    where the curve falls), else the Illinois method (the interpolated crossing, with the
    weight of an end that has stayed twice halved, so a curved attainment does not stall it).
    """
    lo, hi, f_lo, f_hi = 0.0, math.inf, 1.0, -1.0  # f: attainment - alpha at the ends
    floor = hint * 1e-4
    rate, step, downs, last = hint, 1.25, 0, 0
    while True:
        f = attainment_at(rate) - alpha
        side = 1 if f >= 0 else -1
        if side > 0:
            lo, f_lo = rate, f
            f_hi = f_hi / 2 if last == side else f_hi
        else:
            hi, f_hi = rate, f
            f_lo = f_lo / 2 if last == side else f_lo
        last = side
        if hi == math.inf:
            rate, step = lo * step, step * step
            if not math.isfinite(rate):  # met at every rate a float holds: it bounds nothing
                raise InvalidRequest(
                    f"attainment {alpha} is met at every rate up to {lo:.3g} requests/s: the "
                    "SLO bounds nothing; give latencies a placement can miss"
                )
        elif lo == 0.0:
            if hi <= floor:
                return 0.0, hi
            downs += 1
            rate, step = (floor if downs == 3 else hi / step), step * step
        elif hi - lo <= rel_tol * hi:
            return lo, hi
        elif f_lo >= 1.0 - alpha or f_hi <= -alpha:
            rate, last = (lo + hi) / 2, 0
        else:
            edge = rel_tol * hi / 4
            aim = lo + f_lo / (f_lo - f_hi) * (hi - lo)
            rate = min(max(aim, lo + edge), hi - edge)


def max_rate(
    attainment_at: Callable[[float], float],
    alpha: float,
    hint: float,
    rel_tol: float = REL_TOL,
) -> float:
    """The highest rate r with attainment_at(r) >= alpha, to rel_tol; 0 if none above hint/1e4."""
    return bracket(attainment_at, alpha, hint, rel_tol)[0]


def goodput(
    cluster: SimCluster,
    workload: Workload | TraceWorkload,
    slo: Slo,
    alpha: float,
    *,
    min_requests: int = 1000,
    seed: int = 0,
    hint: float | None = None,
) -> GoodputEstimate:
    """The search's quick estimate of the cluster's goodput on the workload, with its interval.

    Each probe simulates n requests and judges the middle half: the first quarter fills the
    cluster (warm-up), the last quarter keeps it loaded until the judged ones finish. n is at
    least 8x the requests the cluster can hold at once, so both quarters cover its batches.
    """
    requests = workload.sample(min_requests, seed)
    n = max(min_requests, 8 * concurrency(cluster, requests))
    if n > min_requests:
        requests = workload.sample(n, seed)
    crossing = Crossing(cluster, requests, slo, alpha, n // 4)
    lo, hi = bracket(crossing.attainment, alpha, hint or capacity_hint(cluster, requests))
    if lo == 0.0:
        return GoodputEstimate(0.0, 0.0, 0.0, n)
    return crossing.estimate(lo, hi)


def refine(
    cluster: SimCluster,
    workload: Workload | TraceWorkload,
    slo: Slo,
    alpha: float,
    quick: GoodputEstimate,
    *,
    precision: float,
    budget: int,
    seed: int = 0,
) -> GoodputEstimate:
    """The goodput to a precision: from the quick estimate (`goodput`'s, same workload and seed),
    longer runs until the 95% interval's half-width is within `precision` of the rate, or until
    the next run would take the requests simulated past `budget` (the estimate then says how
    wide its interval is). A budget in simulated requests, not seconds, so the same plan comes
    out however loaded the host is.

    A longer run keeps the quick estimate's warm-up and tail and judges more requests; how many
    comes from the last interval (its width falls as 1/sqrt(judged)), with a margin. The quick
    estimate's interval is rough (a slope over a wide span of few requests), so the first longer
    run is at most FIRST_GROWTH times as long, and its interval sizes the next. Each run probes
    the last rate -+ about its interval's half-width and interpolates (`Crossing.near`).
    """
    estimate, n = quick, quick.requests
    edge = n // 4
    width = estimate.rel_halfwidth
    left, refined = budget, False
    while estimate.rate > 0 and width > precision:
        judged = n - 2 * edge
        growth = max(1.25, MARGIN * (width / precision) ** 2)
        growth = growth if refined else min(FIRST_GROWTH, growth)
        affordable = left / PROBES_PER_REFINE - 2 * edge
        if affordable < 2 * judged:
            break
        n = 2 * edge + int(min(judged * growth, affordable))
        crossing = Crossing(cluster, workload.sample(n, seed), slo, alpha, edge)
        scaled = width * math.sqrt(judged / (n - 2 * edge))
        estimate = crossing.estimate(*crossing.near(estimate.rate, min(0.05, max(0.01, scaled))))
        left -= crossing.simulated
        # An interval is itself an estimate: after the first longer run, go on from the wider
        # of this one and the last one scaled to this length, so one that came out narrow by
        # chance does not end the run. (The quick estimate's is too rough to hold one to.)
        width = max(estimate.rel_halfwidth, scaled) if refined else estimate.rel_halfwidth
        refined = True
    return estimate


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
        over = latency.iteration_overhead_ms + latency.iteration_overhead_ms_per_token * k * prompt
        stage = lat.prefill_ms(k * prompt, k * square) / inst.pp + latency.stage_overhead_ms + over
        rates.append(1000 * k / stage)  # a batch enters the pipeline every stage time
    if inst.role in ("decode", "colocated") and output > 1:
        # pp lanes, each with 1/pp of the seats and memory, each stepping the whole model
        seats, room = inst.max_num_seqs // inst.pp, inst.kv_capacity // inst.pp
        batch = max(1, min(seats, int(room // (prompt + output))))
        context = batch * (prompt + output / 2)
        step = lat.decode_ms(batch, context) + latency.iteration_overhead_ms
        step += latency.iteration_overhead_ms_per_token * context
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
