"""How fast the planner sees a burst and how often it sees one that is not there: the surge
test of services/planner/surge.py (`arrival_rate`, a Poisson CUSUM over the window's
arrivals) on simulated Poisson arrivals, judged when the control loop judges it
(services/planner/control.py): at each reported arrival (at most every `SURGE_CHECK_S`) and at
each tick of 1 s.

For each rate: `false_surges_per_10h` over `--hours` of constant load (a flag counts once per
cool-down: a decision after it holds that long), and the delay from the start of a tripled rate
to the first check that flags it (`--trials` bursts of 60 s, each starting at a random point of
a tick): median and p90, and how many went unflagged.
No mesh, no emulated engine: arrival times only.

    .venv/bin/python bench/planner/surge.py [--rates 1,3.8,20] [--hours 10] [--trials 50]
        [--surge-factor 2] [--surge-threshold 11]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from distserve.loadgen.report import host
from distserve.loadgen.requests import poisson_arrivals
from services.planner.autoscale import AutoscaleConfig
from services.planner.control import SURGE_CHECK_S
from services.planner.surge import SurgeConfig, arrival_rate

TICK_S = 1.0  # the control loop's default --decide-every-s


def flagged(config: AutoscaleConfig, arrivals: np.ndarray, now: float) -> bool:
    """What a check at `now` finds: the window's arrivals, its rate, a surge or not."""
    lo, hi = np.searchsorted(arrivals, [now - config.window_s, now], "right")
    measured = arrival_rate(arrivals[lo:hi].tolist(), now, 0.0, config.window_s, config.surge)
    return measured is not None and measured[1] is not None


def checks(arrivals: np.ndarray, start: float, end: float) -> np.ndarray:
    """When the loop tests for a surge in [start, end): at arrivals at most every
    SURGE_CHECK_S, and at every tick."""
    at, last = [], -np.inf
    for t in arrivals[(arrivals >= start) & (arrivals < end)]:
        if t - last >= SURGE_CHECK_S:
            at.append(t)
            last = t
    return np.sort(np.concatenate([at, np.arange(np.ceil(start), end, TICK_S)]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="1,3.8,20", help="req/s, comma-separated")
    p.add_argument("--hours", type=float, default=10.0, help="of constant load per rate")
    p.add_argument("--trials", type=int, default=50, help="bursts per rate")
    p.add_argument("--seed", type=int, default=1)
    defaults = SurgeConfig()
    p.add_argument("--surge-factor", type=float, default=defaults.factor)
    p.add_argument("--surge-threshold", type=float, default=defaults.threshold)
    args = p.parse_args()
    config = AutoscaleConfig(budget=1, surge=SurgeConfig(args.surge_factor, args.surge_threshold))
    rng = np.random.default_rng(args.seed)
    started = time.time()
    rows = {}
    for rate in (float(r) for r in args.rates.split(",")):
        horizon = args.hours * 3600
        steady = poisson_arrivals(rng, rate, int(rate * horizon * 1.1) + 10)
        steady = steady[steady < horizon]
        false, quiet_until = 0, 0.0
        for t in checks(steady, config.window_s, horizon):
            if t >= quiet_until and flagged(config, steady, t):
                false, quiet_until = false + 1, t + config.cooldown_s
        delays = []
        for _ in range(args.trials):
            start = 100.0 + rng.uniform(0, TICK_S)
            before = poisson_arrivals(rng, rate, int(rate * 120) + 10)
            burst = start + poisson_arrivals(rng, 3 * rate, int(3 * rate * 60) + 10)
            arrivals = np.concatenate([before[before < start], burst])
            at = checks(arrivals, start, start + 60)
            delays.append(next((t - start for t in at if flagged(config, arrivals, t)), np.inf))
        p50, p90 = (float(np.percentile(delays, q)) for q in (50, 90))
        rows[f"{rate:g}"] = {
            "false_surges_per_10h": round(false * 10 / args.hours, 2),
            # None: more than that share of the bursts went unflagged for their 60 s
            "burst_x3_detection_s_p50": round(p50, 2) if np.isfinite(p50) else None,
            "burst_x3_detection_s_p90": round(p90, 2) if np.isfinite(p90) else None,
            "bursts_unflagged": int(np.sum(~np.isfinite(delays))),
        }
        print(f"{rate:g} req/s: {rows[f'{rate:g}']}", file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "engine": "none (simulated Poisson arrivals; the planner's own surge test)",
                "surge_factor": config.surge.factor,
                "surge_threshold": config.surge.threshold,
                "tick_s": TICK_S,
                "surge_check_s": SURGE_CHECK_S,
                "hours": args.hours,
                "by_rate": rows,
                "hardware": host(),
                "wall_s": round(time.time() - started, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
