"""The planner's decisions on a running mesh: how many instances of each role, from the
workload it measures, within a budget of devices, never oscillating.

`Autoscaler.decide(view)` is pure (no I/O, its own clock given in the view): the service calls
it on a timer with what it measured and hands a `scale` decision to an actuator
(services/planner/actuator.py). The rules, each against a fault users of other planners report:

* **One change at a time.** While a change is in flight (the actuator is applying one, or the
  registry does not yet show the last target) the answer is `wait`, and for `cooldown_s` after
  a change lands it is `hold`: a decision is taken on what the new placement measures, never
  on what the old one left behind (NVIDIA Dynamo #9774).
* **Up when the SLO is at risk.** The measured window (its requests' arrival gaps and lengths,
  replayed by the simulator at the measured rate) is predicted to miss the attainment target on
  the current placement, or missed it as observed. The new placement is the smallest within
  the budget predicted to meet it at `up_headroom` x the rate, or, when none does, the one
  predicted best at the rate; it is taken only if it predicts `margin` more attainment than
  the current one (a reshape of the same size included: a workload change may need more
  decode and less prefill, not more devices).
* **Down only when it stays safe.** A smaller placement is taken only if it is predicted to
  meet the target at `down_headroom` x the rate (above `up_headroom`: a band in which neither
  rule fires, so noise in the measured rate cannot scale 2 -> 1 -> 2 under a constant load,
  Dynamo #9294), only when the current one meets the SLO as observed, and only after it was
  found safe at every decision for `down_stabilization_s` on the current placement (up is
  fast, down is slow, as Kubernetes' HPA stabilises scale-down): to the largest placement
  found safe over that period. One noisy window cannot take the mesh down to send it back up.
* **A budget it never exceeds**: candidates are the instance counts whose devices fit it.
* **Rates are arrivals, seen as they come.** The gateway reports each request when it is
  accepted (and again when it finishes, with its latencies): the rate is arrivals over the
  window, and a surge (a Poisson CUSUM's evidence of a rise to twice the window's rate) is
  decided on at its own rate at once, not a request's latency and a window later.
* **Idle shrinks**: fewer than MIN_SAMPLES requests over a whole window since the last change
  (or the start) scale the pool down to its smallest placement.
* **State**: the correction below, and the down-scaling records above; `decide` does no I/O.
* **The latency model is corrected by what the mesh measures.** Each window judged on a
  settled placement compares its observed median TTFT and TPOT with the simulator's on the
  same requests and placement (the uncorrected model); the ratios, clamped to
  `correction_bounds` and smoothed (`correction_weight` of each new one), scale the model's
  prefill and decode step times for every prediction after (`Autoscaler.correction`, and
  each decision's `correction`).

The tensor degree of each role is the mesh's (instances are resized, not re-sharded).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from services.common.errors import InvalidRequest
from services.common.latency import Coefficients, LatencyModel, TpLatency
from services.planner.drift import Sample
from services.planner.placement import PlanSpec, sim_cluster, sim_instance
from services.planner.simulator import simulate
from services.planner.workload import Requests

MIN_SAMPLES = 20  # a window with fewer finished requests decides nothing


@dataclass(frozen=True)
class AutoscaleConfig:
    budget: int  # devices the mesh may use
    window_s: float = 60.0  # the measured workload: requests that arrived this long ago at most
    up_headroom: float = 1.2
    down_headroom: float = 1.5
    margin: float = 0.05  # attainment a change must add (a scale-up or a reshape)
    cooldown_s: float = 30.0
    # a smaller placement must have been predicted safe at every decision this long (since the
    # last change) before it is taken, and the largest of those predictions is what is taken
    down_stabilization_s: float = 120.0
    replay: int = 600  # requests the simulator replays per prediction (the window repeated)
    correction_weight: float = 0.3  # the share of each window's observed/predicted ratio
    correction_bounds: tuple[float, float] = (0.5, 2.0)  # the most a correction scales by
    # A surge: a Poisson CUSUM over the window's arrivals for a rise to `surge_factor` x the
    # window's rate passes `surge_threshold` (nats of evidence). Tested as arrivals come
    # (services/planner/control.py), 2 and 11 give 0 / 0 / 1 false surges per 10 h at 1 / 3.8 /
    # 20 req/s and see a tripled rate after 2.9 s (median) at 3.8 req/s, 0.6 s at 20 (10: 3
    # false surges per 10 h at 20 req/s, 2.7 s): bench/surge.py
    surge_factor: float = 2.0
    surge_threshold: float = 11.0

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise InvalidRequest(f"a budget is >= 1 device, got {self.budget}", "budget")
        if self.down_stabilization_s < 0:
            raise InvalidRequest(
                f"--down-stabilization-s is >= 0 s, got {self.down_stabilization_s:g}"
            )
        if not 1.0 <= self.up_headroom < self.down_headroom:
            raise InvalidRequest(
                "headrooms: 1 <= up < down (the band between them is what keeps a constant "
                f"load from scaling back and forth), got up {self.up_headroom}, "
                f"down {self.down_headroom}"
            )


@dataclass(frozen=True)
class View:
    """What the planner sees now."""

    now_s: float
    samples: tuple[Sample, ...]  # finished requests, in the order they finished (any age)
    counts: Mapping[str, int]  # instances per role now (the registry's view)
    in_flight: bool = False  # a change is being applied
    last_change_s: float = -math.inf  # when the last change landed
    # when requests arrived (the gateway reports each as it is accepted), counted since
    # `arrivals_since_s`; none reported: the rate is measured from the finished requests
    arrivals: tuple[float, ...] = ()
    arrivals_since_s: float = -math.inf


@dataclass(frozen=True)
class Decision:
    action: str  # "scale", "hold" or "wait"
    reason: str
    counts: dict[str, int]  # the target (the current counts unless action is "scale")
    rate: float = 0.0  # measured, requests/s
    observed: float = math.nan  # attainment observed in the window
    predicted: dict[str, float] = field(default_factory=dict)  # "current"/"target" at the rate
    # step-time factors applied to the latency model ("prefill", "decode"; 1: as profiled)
    correction: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "action": self.action,
            "reason": self.reason,
            "counts": self.counts,
            "rate_rps": round(float(self.rate), 4),
            "observed_attainment": None if math.isnan(self.observed) else round(self.observed, 4),
            "predicted_attainment": {k: round(v, 4) for k, v in self.predicted.items()},
            "latency_correction": {k: round(v, 4) for k, v in self.correction.items()},
        }


class Autoscaler:
    """Decisions for one pool. `spec` gives the model, SLO, attainment target and latency
    models (its workload and rate are ignored: the measured ones are used); `tp` is each
    role's tensor degree in the mesh."""

    def __init__(self, spec: PlanSpec, tp: Mapping[str, int], config: AutoscaleConfig) -> None:
        self.spec, self.tp, self.config = spec, dict(tp), config
        roles = sorted(self.tp)
        if not roles or not (set(roles) <= {"prefill", "decode"} or roles == ["colocated"]):
            raise InvalidRequest(f"roles {roles}: prefill and decode, or colocated alone")
        self.roles = roles
        self._instances = {r: sim_instance(spec, r, self.tp[r]) for r in roles}
        self._profiled = spec  # the latency models as profiled; self.spec's are corrected
        self.correction = {"prefill": 1.0, "decode": 1.0}
        # (when, the smallest placement safe then) for each decision on `_safe_on` since the
        # last change: what a scale-down is stabilised over
        self._safe: list[tuple[float, dict[str, int]]] = []
        self._safe_on: dict[str, int] = {}

    def devices(self, counts: Mapping[str, int]) -> int:
        return sum(counts.get(r, 0) * self.tp[r] for r in self.roles)

    def candidates(self) -> list[dict[str, int]]:
        """Every instance count per role (each >= 1) within the budget, fewest devices first."""
        ranges = [range(1, self.config.budget // self.tp[r] + 1) for r in self.roles]
        out = [
            dict(zip(self.roles, c, strict=True))
            for c in itertools.product(*ranges)
            if self.devices(dict(zip(self.roles, c, strict=True))) <= self.config.budget
        ]
        return sorted(out, key=lambda c: (self.devices(c), tuple(c.values())))

    def predict(self, counts: Mapping[str, int], requests: Requests) -> float:
        """Attainment the simulator predicts for `requests` on `counts` instances (with the
        latency model as corrected so far)."""
        result = self._simulate(self.spec, counts, requests)
        return 0.0 if result is None else result.attainment(self.spec.slo)

    def _simulate(self, spec: PlanSpec, counts: Mapping[str, int], requests: Requests):
        """The simulator's run of `requests` on `counts` instances (None: no prefill or no
        decode capacity)."""
        instances = tuple(
            inst for r in self.roles for inst in [self._instances[r]] * counts.get(r, 0)
        )
        if not any(i.role in ("decode", "colocated") for i in instances) or not any(
            i.role in ("prefill", "colocated") for i in instances
        ):
            return None
        return simulate(sim_cluster(spec, instances), requests)

    def correct(self, counts: Mapping[str, int], window: list[Sample], requests: Requests) -> None:
        """Move the correction toward observed/predicted median TTFT (prefill) and TPOT
        (decode) of `window` on `counts`, predicted by the profiled model on `requests` (the
        window's replay at its rate)."""
        result = self._simulate(self._profiled, counts, requests)
        if result is None:
            return
        lo, hi = self.config.correction_bounds
        w = self.config.correction_weight
        for phase, observed, predicted in (
            ("prefill", [s.ttft_ms / 1000 for s in window], result.ttft),
            ("decode", [s.tpot_ms / 1000 for s in window if s.output_tokens > 1], result.tpot),
        ):
            predicted = np.asarray(predicted)
            predicted = predicted[predicted > 0]
            if not observed or not len(predicted):
                continue
            ratio = min(hi, max(lo, float(np.median(observed) / np.median(predicted))))
            self.correction[phase] = (1 - w) * self.correction[phase] + w * ratio
        p, d = self.correction["prefill"], self.correction["decode"]
        self.spec = dataclasses.replace(
            self._profiled,
            latency=_scaled(self._profiled.latency, p, d),
            colocated_latency=_scaled(self._profiled.colocated_latency, p, d),
        )

    def decide(self, view: View) -> Decision:
        decision = self._decide(view)
        return dataclasses.replace(decision, correction=dict(self.correction))

    def _decide(self, view: View) -> Decision:
        current = {r: view.counts.get(r, 0) for r in self.roles}
        if view.in_flight:
            return Decision("wait", "a change is being applied", current)
        if view.now_s - view.last_change_s < self.config.cooldown_s:
            return Decision("hold", "cooling down after the last change", current)
        window = [s for s in view.samples if s.arrival_s >= view.now_s - self.config.window_s]
        if len(window) < MIN_SAMPLES:
            smallest = self.candidates()[0]
            idle = view.now_s - view.last_change_s >= self.config.window_s
            if idle and self.devices(smallest) < self.devices(current):
                why = f"{len(window)} requests in {self.config.window_s:g} s: idle"
                return Decision("scale", why, smallest)
            return Decision("hold", f"{len(window)} requests measured: too few to decide", current)
        rate, requests = _replay(window, self.config.replay)
        rate, surge = self._arrival_rate(view, rate)
        settled = [s for s in window if s.arrival_s >= view.last_change_s]  # on `current`
        if len(settled) >= MIN_SAMPLES:
            settled_rate, settled_requests = _replay(settled, self.config.replay)
            self.correct(current, settled, settled_requests.at_rate(settled_rate))
        slo = self.spec.slo
        observed = float(np.mean([slo.met(s.ttft_ms / 1000, s.tpot_ms / 1000) for s in window]))

        def at(factor: float):
            return requests.at_rate(rate * factor)

        alpha = self.spec.alpha
        now = self.predict(current, at(1.0))
        base = {"current": now}
        if now < alpha or observed < alpha:
            ranked = []  # the smallest that meets it at the headroom, else the best at it
            for c in self.candidates():
                ranked.append((self.predict(c, at(self.config.up_headroom)), c))
                if ranked[-1][0] >= alpha:
                    break
            target = max(ranked, key=lambda x: x[0])[1]
            then = self.predict(target, at(1.0))
            predicted = {**base, "target": then}
            why = (
                f"{surge}SLO at risk at {rate:.3g} req/s (predicted {now:.1%}, observed "
                f"{observed:.1%}, target {alpha:.0%})"
            )
            if target == current or then < now + self.config.margin:
                self._stabilised(view, current, current)  # nothing smaller is safe now
                return Decision(
                    "hold",
                    why + ": no placement in the budget does better",
                    current,
                    rate,
                    observed,
                    predicted,
                )
            return Decision("scale", why, target, rate, observed, predicted)
        smallest = next(
            (
                c
                for c in self.candidates()
                if self.devices(c) < self.devices(current)
                and self.predict(c, at(self.config.down_headroom)) >= alpha
            ),
            current,
        )
        target = self._stabilised(view, current, smallest)
        if target is None:
            why = "the SLO is met and no smaller placement is safe"
            if smallest != current:
                why = (
                    f"the SLO is met; {self.devices(smallest)} devices would be, once safe at "
                    f"every decision for {self.config.down_stabilization_s:g} s"
                )
            return Decision("hold", why, current, rate, observed, base)
        predicted = {**base, "target": self.predict(target, at(1.0))}
        why = (
            f"{self.devices(target)} devices have met the SLO at "
            f"{self.config.down_headroom:g}x the measured rate for "
            f"{self.config.down_stabilization_s:g} s (now {rate:.3g} req/s)"
        )
        return Decision("scale", why, target, rate, observed, predicted)

    def _stabilised(self, view: View, current: dict, smallest: dict) -> dict | None:
        """Record that `smallest` is the smallest placement safe now; return the placement to
        scale down to, or None. Down is slow (as Kubernetes' HPA stabilises scale-down): to the
        largest of the placements found safe at every decision of the last
        `down_stabilization_s`, and only once the records since the last change (on this
        placement) span that long. One noisy window (a run of short outputs, a lull) then
        cannot take the mesh down just to send it back up."""
        stab = self.config.down_stabilization_s
        kept = [
            (t, c)
            for t, c in self._safe
            if self._safe_on == current and view.last_change_s <= t <= view.now_s
        ]
        self._safe_on = dict(current)
        self._safe = [*kept[-1000:], (view.now_s, dict(smallest))]
        if self._safe[0][0] > view.now_s - stab:
            return None  # not yet measured for long enough on this placement
        period = [c for t, c in self._safe if t >= view.now_s - stab]
        largest = max(reversed(period), key=self.devices)
        return largest if self.devices(largest) < self.devices(current) else None

    def _arrival_rate(self, view: View, finished_rate: float) -> tuple[float, str]:
        """The arrival rate to decide on, and "" or what makes it a surge: `arrival_rate` of
        the arrivals the gateway reported, or, with none reported, `finished_rate` (the
        finished requests': a request's latency late). In a surge the rate is the surge's
        own: a burst is decided on as soon as there is evidence of it, not a window later."""
        measured = arrival_rate(view.arrivals, view.now_s, view.arrivals_since_s, self.config)
        if measured is None:
            return finished_rate, ""
        rate, surge = measured
        if surge is None:
            return rate, ""
        why = (
            f"a surge ({surge.arrivals} arrivals in the last {surge.seconds:.3g} s, "
            f"{rate:.3g} req/s before): "
        )
        return surge.rate, why


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


def _replay(window: list[Sample], n: int) -> tuple[float, Requests]:
    """The window's rate and its requests (gaps and lengths as measured) at 1 request/s,
    repeated to `n`: enough for the simulator to reach a steady state. The samples may come in
    any order (a feed reports requests as they finish): they are put in arrival order."""
    window = sorted(window, key=lambda s: s.arrival_s)
    t = np.array([s.arrival_s for s in window], dtype=float)
    t -= t[0]
    span = t[-1] * len(t) / (len(t) - 1) if t[-1] > 0 else float(len(t))
    rate = len(t) / span
    reps = -(-n // len(t))
    arrivals = np.concatenate([t + k * span for k in range(reps)])[:n] * rate
    prompt = np.tile([s.prompt_tokens for s in window], reps)[:n]
    output = np.tile([s.output_tokens for s in window], reps)[:n]
    return rate, Requests(arrivals, prompt, output)


def _scaled(lat: LatencyModel, prefill: float, decode: float) -> LatencyModel:
    """`lat` with its prefill step times times `prefill` and its decode step times times
    `decode` (L_m, a ratio of coefficients, unchanged)."""

    def times(c: Coefficients, k: float) -> Coefficients:
        return Coefficients(c.a * k, c.b * k, c.c * k)

    by_tp = {
        tp: TpLatency(
            times(t.prefill, prefill),
            times(t.decode_small, decode),
            times(t.decode_large, decode),
            t.threshold,
        )
        for tp, t in lat.by_tp.items()
    }
    source = f"{lat.source}, corrected x{prefill:.3g} prefill, x{decode:.3g} decode"
    return dataclasses.replace(lat, by_tp=by_tp, source=source)
