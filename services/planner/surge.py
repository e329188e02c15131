"""The planner's surge test: a Poisson CUSUM over the arrivals the gateway reports, so that a
burst is decided on as soon as there is evidence of it, not a window later
(services/planner/autoscale.py calls it; `bench/planner/surge.py` measures its false surges and
delay).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.planner.autoscale import AutoscaleConfig


@dataclass(frozen=True)
class Surge:
    """Evidence of a rise in the arrival rate: `arrivals` since it began, `seconds` ago."""

    arrivals: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.arrivals / self.seconds


def arrival_rate(
    arrivals: Iterable[float], now_s: float, since_s: float, config: AutoscaleConfig
) -> tuple[float, Surge | None] | None:
    """The arrival rate over the window (over the part of it since arrivals are counted,
    `since_s`) and the surge in it, if any (`detect_surge`); None when no arrival is counted."""
    start = max(now_s - config.window_s, since_s)
    counted = sorted(t for t in arrivals if start <= t <= now_s)
    if not counted or now_s <= start:
        return None
    rate = len(counted) / (now_s - start)
    return rate, detect_surge(counted, now_s, rate, config)


def detect_surge(
    arrivals: list[float], now_s: float, rate: float, config: AutoscaleConfig
) -> Surge | None:
    """A Poisson CUSUM: the log-likelihood ratio of the (sorted) arrivals at `surge_factor` x
    `rate` against `rate`, restarted at 0 whenever it falls there. Past `surge_threshold` it is
    a surge, counted from when it started rising. Else None."""
    gain = math.log(config.surge_factor)  # each arrival's evidence
    drain = (config.surge_factor - 1) * rate  # evidence lost per second without one
    score, prev, start, n = 0.0, arrivals[0], arrivals[0], 0
    for t in arrivals:
        score -= drain * (t - prev)
        prev = t
        if score <= 0:
            score, start, n = 0.0, t, 0
        score += gain
        n += 1
    score -= drain * (now_s - prev)
    if score <= config.surge_threshold or now_s <= start:
        return None
    return Surge(n, now_s - start)
