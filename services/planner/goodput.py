"""Goodput: the highest request rate at which a fraction alpha of requests meet both SLOs.

Found on the simulator, as an estimate with a 95% confidence interval and the number of
simulated requests behind it (`GoodputEstimate`):

1. A search pass: the requests are sampled once at unit rate and rescaled (`Requests.at_rate`),
   so every probe sees the same prompts, outputs and arrival pattern (common random numbers) and
   attainment falls with the rate without sampling noise between the probes. Bisection brackets
   the rate where attainment crosses alpha to 2%; the goodput is interpolated between the
   bracket's ends.
2. The interval: the judged requests split into `BATCHES` consecutive batches whose attainments
   give the attainment's standard error (batch means: neighbouring requests share a queue, so
   single requests are not independent); divided by the attainment curve's slope across the
   bracket it is the rate's (the delta method).
3. With a precision asked (`rel_halfwidth`), while the interval is wider than that the run is
   lengthened (more judged requests, the same warm-up and tail) by the factor the interval's
   width says it needs, and the crossing found again on the longer sample, near the last one.
   A longer sample extends the shorter (`Workload.sample` is prefix-stable), so every candidate
   placement and every probe still sees the same draws.

The spread of a short estimate comes from the queueing itself: at the goodput, whether a tenth
of the requests miss hangs on a few bursts of arrivals, so only more judged requests narrow it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from services.common.latency import LatencyModel
from services.common.slo import Slo
from services.planner.simulator import Instance, SimCluster, simulate
from services.planner.workload import Requests, TraceWorkload, Workload

REL_TOL = 0.02  # bisection stops when the bracket is within 2% of its upper end
BATCHES = 20  # batch means for the attainment's standard error
T_975 = 2.093  # Student's t, 97.5th percentile, BATCHES - 1 degrees of freedom
STEP = 0.02  # relative step that brackets the crossing again on a longer sample
MAX_GROWTH = 16  # a longer sample is at most this many times the last one's judged requests


@dataclass(frozen=True)
class GoodputEstimate:
    """A goodput (req/s), its 95% confidence interval [low, high], and the requests simulated in
    each probe behind it (warm-up and tail included)."""

    rate: float
    low: float
    high: float
    requests: int

    @property
    def rel_halfwidth(self) -> float:
        """Half the interval's width relative to the rate (0 for a zero goodput)."""
        return (self.high - self.low) / 2 / self.rate if self.rate > 0 else 0.0

    def scaled(self, factor: float) -> GoodputEstimate:
        """The same estimate in other units (e.g. per GPU)."""
        return GoodputEstimate(
            self.rate * factor, self.low * factor, self.high * factor, self.requests
        )

    def describe(self) -> str:
        """`5.29 req/s [5.23, 5.35] (40,000 requests)`."""
        return (
            f"{self.rate:.3g} req/s [{self.low:.3g}, {self.high:.3g}] ({self.requests:,} requests)"
        )

    def to_json(self) -> dict:
        return {
            "rps": round(self.rate, 4),
            "ci95_rps": [round(self.low, 4), round(self.high, 4)],
            "requests": self.requests,
        }


def bracket(
    attainment_at: Callable[[float], float],
    alpha: float,
    hint: float,
    rel_tol: float = REL_TOL,
) -> tuple[float, float]:
    """(lo, hi): attainment_at(lo) >= alpha > attainment_at(hi), hi - lo <= rel_tol * hi;
    (0, hi) if nothing above hint/1e4 meets alpha.

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
                return 0.0, hi
            rate = hi / 2
        elif hi - lo <= rel_tol * hi:
            return lo, hi
        else:
            rate = (lo + hi) / 2


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
    rel_halfwidth: float | None = None,
    max_requests: int = 0,
) -> GoodputEstimate:
    """Goodput of the cluster on the workload, with its 95% interval.

    Each probe simulates n requests and judges the middle: the first quarter of the search
    pass's n fills the cluster (warm-up), as many again at the end keep it loaded until the
    judged ones finish. n is at least 8x the requests the cluster can hold at once, so both
    cover its batches. With `rel_halfwidth`, the run grows until the interval's half-width is
    within that fraction of the rate, or n reaches `max_requests` (0: no limit).
    """
    requests = workload.sample(min_requests, seed)
    n = max(min_requests, 8 * concurrency(cluster, requests))
    if n > min_requests:
        requests = workload.sample(n, seed)
    edge = n // 4
    crossing = _Crossing(cluster, requests, slo, alpha, edge)
    lo, hi = bracket(crossing.attainment, alpha, hint or capacity_hint(cluster, requests))
    if lo == 0.0:
        return GoodputEstimate(0.0, 0.0, 0.0, n)
    estimate = crossing.estimate(lo, hi)
    limit = max_requests or math.inf
    width = estimate.rel_halfwidth
    while rel_halfwidth is not None and width > rel_halfwidth and n < limit:
        judged = n - 2 * edge
        growth = min(MAX_GROWTH, max(2.0, 1.3 * (width / rel_halfwidth) ** 2))
        n = int(min(limit, 2 * edge + judged * growth))
        crossing = _Crossing(cluster, workload.sample(n, seed), slo, alpha, edge)
        estimate = crossing.estimate(*crossing.bracket_near(estimate.rate))
        # An interval is itself an estimate: stop on the wider of this one and the last one
        # scaled to this length, so one that came out narrow by chance does not end the run.
        width = max(estimate.rel_halfwidth, width * math.sqrt(judged / (n - 2 * edge)))
    return estimate


class _Crossing:
    """Attainment of one sample at any rate (memoised), and where it crosses alpha."""

    def __init__(
        self, cluster: SimCluster, requests: Requests, slo: Slo, alpha: float, edge: int
    ) -> None:
        self.cluster, self.requests, self.slo, self.alpha = cluster, requests, slo, alpha
        self.edge = edge  # requests of warm-up, and of tail
        self._met: dict[float, np.ndarray] = {}

    def met(self, rate: float) -> np.ndarray:
        """Whether each judged request met both SLOs at this rate."""
        if rate not in self._met:
            n, edge = len(self.requests), self.edge
            result = simulate(self.cluster, self.requests.at_rate(rate), n - edge)
            self._met[rate] = self.slo.met(result.ttft[edge:], result.tpot[edge:])
        return self._met[rate]

    def attainment(self, rate: float) -> float:
        return float(np.mean(self.met(rate)))

    def bracket_near(self, rate: float) -> tuple[float, float]:
        """(lo, hi) around `rate`, STEP apart, then narrowed once at the interpolated crossing."""
        step = 1 + STEP
        if self.attainment(rate) >= self.alpha:
            lo, hi = rate, rate * step
            while self.attainment(hi) >= self.alpha:
                lo, hi = hi, hi * step
        else:
            lo, hi = rate / step, rate
            while self.attainment(lo) < self.alpha:
                lo, hi = lo / step, lo
        mid = self.interpolate(lo, hi)
        if lo < mid < hi:
            if self.attainment(mid) >= self.alpha:
                lo = mid
            else:
                hi = mid
        return lo, hi

    def interpolate(self, lo: float, hi: float) -> float:
        """The rate where the straight line between (lo, A(lo)) and (hi, A(hi)) crosses alpha."""
        a_lo, a_hi = self.attainment(lo), self.attainment(hi)
        return lo + (a_lo - self.alpha) / (a_lo - a_hi) * (hi - lo)

    def estimate(self, lo: float, hi: float) -> GoodputEstimate:
        """The crossing between lo (meets alpha) and hi (misses), with its 95% interval."""
        rate = self.interpolate(lo, hi)
        slope = (self.attainment(lo) - self.attainment(hi)) / (hi - lo)  # attainment per req/s
        stderr = (self._stderr(lo) + self._stderr(hi)) / 2
        half = T_975 * stderr / slope
        return GoodputEstimate(rate, max(0.0, rate - half), rate + half, len(self.requests))

    def _stderr(self, rate: float) -> float:
        met = self.met(rate)
        size = len(met) // BATCHES
        batches = met[: size * BATCHES].reshape(BATCHES, size).mean(axis=1)
        return float(np.std(batches, ddof=1)) / math.sqrt(BATCHES)


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
