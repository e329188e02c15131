"""The planner's surge test: a Poisson CUSUM over the arrivals the gateway reports, so that a
burst is decided on as soon as there is evidence of it, not a window later
(services/planner/autoscale.py and control.py call it; `bench/planner/surge.py` measures its
false surges and delay). It has its own config (`SurgeConfig`): it depends on nothing of the
autoscaler's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from services.common.errors import InvalidRequest


@dataclass(frozen=True)
class SurgeConfig:
    """A surge: the CUSUM for a rise to `factor` x the window's rate passes `threshold` (nats
    of evidence). Tested as arrivals come (services/planner/control.py), 2 and 11 give
    0 / 0 / 1 false surges per 10 h at 1 / 3.8 / 20 req/s and see a tripled rate after 2.9 s
    (median) at 3.8 req/s, 0.6 s at 20 (10: 3 false surges per 10 h at 20 req/s, 2.7 s):
    bench/planner/surge.py"""

    factor: float = 2.0
    threshold: float = 11.0

    def __post_init__(self) -> None:
        if self.factor <= 1:
            raise InvalidRequest(f"a surge factor is > 1 (a rise), got {self.factor:g}")
        if self.threshold <= 0:
            raise InvalidRequest(f"a surge threshold is > 0 nats, got {self.threshold:g}")


@dataclass(frozen=True)
class Surge:
    """Evidence of a rise in the arrival rate: `arrivals` since it began, `seconds` ago."""

    arrivals: int
    seconds: float

    @property
    def rate(self) -> float:
        return self.arrivals / self.seconds


def arrival_rate(
    arrivals: Iterable[float], now_s: float, since_s: float, window_s: float, config: SurgeConfig
) -> tuple[float, Surge | None] | None:
    """The arrival rate over the last `window_s` (over the part of it since arrivals are
    counted, `since_s`) and the surge in it, if any (`detect_surge`); None when no arrival is
    counted."""
    start = max(now_s - window_s, since_s)
    counted = sorted(t for t in arrivals if start <= t <= now_s)
    if not counted or now_s <= start:
        return None
    rate = len(counted) / (now_s - start)
    return rate, detect_surge(counted, now_s, rate, config)


def detect_surge(
    arrivals: list[float], now_s: float, rate: float, config: SurgeConfig
) -> Surge | None:
    """A Poisson CUSUM: the log-likelihood ratio of the (sorted) arrivals at `config.factor` x
    `rate` against `rate`, restarted at 0 whenever it falls there. Past `config.threshold` it
    is a surge, counted from when it started rising. Else None."""
    gain = math.log(config.factor)  # each arrival's evidence
    drain = (config.factor - 1) * rate  # evidence lost per second without one
    score, prev, start, n = 0.0, arrivals[0], arrivals[0], 0
    for t in arrivals:
        score -= drain * (t - prev)
        prev = t
        if score <= 0:
            score, start, n = 0.0, t, 0
        score += gain
        n += 1
    score -= drain * (now_s - prev)
    if score <= config.threshold or now_s <= start:
        return None
    return Surge(n, now_s - start)
