"""A goodput estimate and the crossing it comes from: where attainment falls below alpha.

`Crossing` holds one sample of requests and simulates it at any rate (memoised; the sample is
rescaled, so every rate sees the same arrivals and lengths: common random numbers). Its
`estimate` interpolates the crossing between two probed rates and gives a 95% interval by the
delta method: the attainment's standard error from batch means (neighbouring requests share a
queue, so single requests are not independent), divided by the attainment curve's slope over
the widest pair of probes within `SLOPE_SPAN` of the crossing (a slope over a narrow bracket of a
short run is a few requests' worth and makes the interval swing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from services.common.slo import Slo
from services.planner.simulator import SimCluster, simulate
from services.planner.workload import Requests

BATCHES = 20  # batch means for the attainment's standard error
T_975 = 2.093  # Student's t, 97.5th percentile, BATCHES - 1 degrees of freedom
SLOPE_SPAN = 0.10  # the slope's probes lie within this fraction of the crossing


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


class Crossing:
    """Attainment of one sample at any rate (memoised), and where it crosses alpha.

    The first and last `edge` requests are simulated but not judged: the first fill the cluster
    (warm-up), the last keep it loaded until the judged ones finish.
    """

    def __init__(
        self, cluster: SimCluster, requests: Requests, slo: Slo, alpha: float, edge: int
    ) -> None:
        self.cluster, self.requests, self.slo, self.alpha = cluster, requests, slo, alpha
        self.edge = edge
        self._met: dict[float, np.ndarray] = {}
        self.simulated = 0  # requests simulated, over all probes

    def met(self, rate: float) -> np.ndarray:
        """Whether each judged request met both SLOs at this rate."""
        if rate not in self._met:
            n, edge = len(self.requests), self.edge
            result = simulate(self.cluster, self.requests.at_rate(rate), n - edge)
            self._met[rate] = self.slo.met(result.ttft[edge:], result.tpot[edge:])
            self.simulated += n - edge
        return self._met[rate]

    def attainment(self, rate: float) -> float:
        return float(np.mean(self.met(rate)))

    def interpolate(self, lo: float, hi: float) -> float:
        """The rate where the straight line between (lo, A(lo)) and (hi, A(hi)) crosses alpha."""
        a_lo, a_hi = self.attainment(lo), self.attainment(hi)
        if a_lo == a_hi:
            return (lo + hi) / 2
        return lo + (a_lo - self.alpha) / (a_lo - a_hi) * (hi - lo)

    def near(self, rate: float, span: float) -> tuple[float, float]:
        """(lo, hi) around `rate`: probes at rate * (1 -+ span), stepped outward until they
        bracket the crossing; a bracket wider than 3% is narrowed once at the interpolated
        crossing (inside 3%, the line between the ends is as good as another probe)."""
        lo, hi = rate * (1 - span), rate * (1 + span)
        while self.attainment(lo) < self.alpha:
            lo, hi = lo * (1 - 2 * span), lo
        while self.attainment(hi) >= self.alpha:
            lo, hi = hi, hi * (1 + 2 * span)
        mid = self.interpolate(lo, hi)
        if hi - lo > 0.03 * hi and lo < mid < hi:
            if self.attainment(mid) >= self.alpha:
                lo = mid
            else:
                hi = mid
        return lo, hi

    def estimate(self, lo: float, hi: float) -> GoodputEstimate:
        """The crossing between lo (meets alpha) and hi (misses), with its 95% interval."""
        rate = self.interpolate(lo, hi)
        p, q = self._slope_pair(rate, lo, hi)
        slope = (self.attainment(p) - self.attainment(q)) / (q - p)  # attainment per req/s
        stderr = (self._stderr(lo) + self._stderr(hi)) / 2
        half = T_975 * stderr / slope if slope > 0 else rate
        return GoodputEstimate(rate, max(0.0, rate - half), rate + half, len(self.requests))

    def _slope_pair(self, rate: float, lo: float, hi: float) -> tuple[float, float]:
        """The farthest-apart probes, one meeting alpha below `rate`, one missing above it, both
        within SLOPE_SPAN of it (at least lo and hi)."""
        near = [r for r in self._met if abs(r - rate) <= SLOPE_SPAN * rate]
        below = [r for r in near if r <= lo and self.attainment(r) >= self.alpha]
        above = [r for r in near if r >= hi and self.attainment(r) < self.alpha]
        return min(below, default=lo), max(above, default=hi)

    def _stderr(self, rate: float) -> float:
        met = self.met(rate)
        size = len(met) // BATCHES
        if size == 0:
            return 0.5
        batches = met[: size * BATCHES].reshape(BATCHES, size).mean(axis=1)
        return float(np.std(batches, ddof=1)) / math.sqrt(BATCHES)
