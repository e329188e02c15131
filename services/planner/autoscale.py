"""The planner's decisions on a running mesh: how many instances of each role, from the
workload it measures, within a budget of devices, never oscillating.

The planner's one decider that moves the mesh (services/planner/__init__.py).
`Autoscaler.decide(view)` is pure (no I/O, its own clock given in the view; `View` and
`Decision` in services/planner/decision.py): the service calls it on a timer with what it
measured and hands a `scale` decision to an actuator (services/planner/actuator.py). The
rules, each against a fault users of other planners report:

* **One change at a time, no reversal in the cool-down.** While a change is in flight (the
  actuator is applying one, or the registry does not yet show the last target) the answer is
  `wait`. For `cooldown_s` after a change lands, a change the other way is held (a scale-down
  or a reshape after a scale-up; anything after a scale-down or a reshape): what the old
  placement left behind is not taken for what the new one measures (NVIDIA Dynamo #9774). A
  scale-up the evidence still asks for after a scale-up goes ahead (`direction`, in
  decision.py: more instances of a role and none fewer, no re-shard), judged on the predicted
  attainment and what was observed since the change only, so a phase that needs more than one
  step is not made to wait one cool-down per step.
* **A new phase is judged from its own requests, seen as they arrive.** When the window's
  arrivals changed prompt lengths (`latest_shift`, drift.py: a split whose mean log prompt
  lengths differ past chance; the gateway reports a prompt's length when it accepts the
  request), the decision holds until MIN_SAMPLES of the new phase's requests have arrived and
  PHASE_MIN_FINISHED have finished (output lengths come only with a finish), then takes them
  alone, at their own arrival rate since the change: the first step aims at the placement the
  new phase needs, not at one fitted to a mix of the two.
* **Requests still running count.** What is replayed is every request that arrived in the
  window (or the phase), not only those that finished: a finished one as measured, a running
  one with its prompt and an output length taken in turn from the finished ones (`_judged`).
  Finished requests alone under-weight the long ones, which are the ones still running.
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
  window, and a surge (services/planner/surge.py) is decided on at its own rate at once, not
  a request's latency and a window later.
* **Idle shrinks**: fewer than MIN_SAMPLES requests over a whole window since the last change
  (or the start) scale the pool down to its smallest placement.
* **State**: the correction below, and the down-scaling records above; `decide` does no I/O.
* **The latency model is corrected by what the mesh measures.** Each window judged on a
  settled placement compares its observed median TTFT and TPOT with the simulator's on the
  same requests and placement (the uncorrected model); the ratios, clamped to
  `correction_bounds` and smoothed (`correction_weight` of each new one), scale the model's
  prefill and decode step times for every prediction after (`Autoscaler.correction`, and
  each decision's `correction`).

* **Re-sharding only when allowed** (`tp_choices`: each role may take any of them its model
  and profile fit); of placements of equal devices, those keeping the mesh's degrees come
  first (a re-shard replaces each instance of the role: a weight load each on real GPUs).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from services.common.errors import FailedPrecondition, InvalidRequest
from services.common.latency import LatencyModel
from services.planner.cluster import kv_capacity
from services.planner.decision import Decision, View, direction
from services.planner.drift import Arrival, Sample, latest_shift
from services.planner.placement import PlanSpec, sim_cluster, sim_instance
from services.planner.simulator import simulate
from services.planner.surge import SurgeConfig, arrival_rate
from services.planner.transition import transition
from services.planner.workload import Requests

MIN_SAMPLES = 20  # a window with fewer finished requests decides nothing
# a new phase is decided on once MIN_SAMPLES of its requests arrived and this many finished:
# their output lengths stand in for those of its requests still running
PHASE_MIN_FINISHED = 5


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
    # the surge test over the window's arrivals (services/planner/surge.py)
    surge: SurgeConfig = field(default_factory=SurgeConfig)
    # tensor degrees a role may be re-sharded to (empty: each role keeps the mesh's degree)
    tp_choices: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise InvalidRequest(f"a budget is >= 1 device, got {self.budget}", "budget")
        if self.down_stabilization_s < 0:
            raise InvalidRequest(
                f"--down-stabilization-s is >= 0 s, got {self.down_stabilization_s:g}"
            )
        if any(t < 1 for t in self.tp_choices):
            raise InvalidRequest(f"tensor degrees are >= 1, got {list(self.tp_choices)}")
        if not 1.0 <= self.up_headroom < self.down_headroom:
            raise InvalidRequest(
                "headrooms: 1 <= up < down (the band between them is what keeps a constant "
                f"load from scaling back and forth), got up {self.up_headroom}, "
                f"down {self.down_headroom}"
            )


class Autoscaler:
    """Decisions for one pool. `spec` gives the model, SLO, attainment target and latency
    models (its workload and rate are ignored: the measured ones are used); `tp` is each
    role's tensor degree in the mesh as it starts (a `View` says what it is later)."""

    def __init__(self, spec: PlanSpec, tp: Mapping[str, int], config: AutoscaleConfig) -> None:
        self.spec, self.tp, self.config = spec, dict(tp), config
        roles = sorted(self.tp)
        if not roles or not (set(roles) <= {"prefill", "decode"} or roles == ["colocated"]):
            raise InvalidRequest(f"roles {roles}: prefill and decode, or colocated alone")
        self.roles = roles
        self._instances = {(r, t): sim_instance(spec, r, t) for r, t in self.tp.items()}
        self._profiled = spec  # the latency models as profiled; self.spec's are corrected
        self.correction = {"prefill": 1.0, "decode": 1.0}
        # (when, the smallest placement safe then) for each decision on `_safe_on` since the
        # last change: what a scale-down is stabilised over
        self._safe: list[tuple[float, tuple]] = []
        self._safe_on: tuple = ()

    def devices(self, counts: Mapping[str, int], tp: Mapping[str, int] | None = None) -> int:
        """Devices of `counts` instances of tensor degree `tp` (default: as built)."""
        tp = tp or self.tp
        return sum(counts.get(r, 0) * tp.get(r, self.tp[r]) for r in self.roles)

    def degrees(self, role: str, now: int) -> list[int]:
        """`now`, and each of `tp_choices` `role`'s model fits and its latency profile has."""
        lat = self.spec.colocated_latency if role == "colocated" else self.spec.latency
        model = self.spec.model
        out = {now}
        for t in self.config.tp_choices:
            if (
                t <= self.config.budget
                and t in lat.by_tp
                and model.num_heads % t == 0
                and kv_capacity(model, t, 1, self.spec.cluster) > 0
            ):
                out.add(t)
        return sorted(out)

    def candidates(
        self, tp: Mapping[str, int] | None = None
    ) -> list[tuple[dict[str, int], dict[str, int]]]:
        """Every (instance count, tensor degree) per role, each count >= 1, within the budget:
        fewest devices first, and of those the ones that re-shard fewest roles from `tp` (the
        mesh's degrees now; default: as built)."""
        now = {r: (tp or {}).get(r) or self.tp[r] for r in self.roles}
        options = [
            [(n, t) for t in self.degrees(r, now[r]) for n in range(1, self.config.budget // t + 1)]
            for r in self.roles
        ]
        out = []
        for combo in itertools.product(*options):
            counts = {r: n for r, (n, _) in zip(self.roles, combo, strict=True)}
            degrees = {r: t for r, (_, t) in zip(self.roles, combo, strict=True)}
            if self.devices(counts, degrees) <= self.config.budget:
                out.append((counts, degrees))

        def key(c):
            counts, degrees = c
            reshards = sum(degrees[r] != now[r] for r in self.roles)
            return (self.devices(counts, degrees), reshards, tuple(counts.values()))

        return sorted(out, key=key)

    def reachable(self, current: tuple, target: tuple) -> bool:
        """Whether the actuator can go from `current` to `target` ((counts, tp) each) within
        the budget without leaving a role with no instance (`transition`): a re-shard at a
        full budget may not."""
        if current[1] == target[1]:
            return True
        live = [(f"{r}-{i}", r, current[1][r]) for r in self.roles for i in range(current[0][r])]
        try:
            transition(live, target[0], target[1], self.config.budget)
        except FailedPrecondition:
            return False
        return True

    def predict(
        self, counts: Mapping[str, int], requests: Requests, tp: Mapping[str, int] | None = None
    ) -> float:
        """Attainment the simulator predicts for `requests` on `counts` instances of tensor
        degree `tp` (default: as built), with the latency model as corrected so far."""
        result = self._simulate(self.spec, counts, requests, tp)
        return 0.0 if result is None else result.attainment(self.spec.slo)

    def _instance(self, role: str, tp: int):
        if (role, tp) not in self._instances:
            self._instances[(role, tp)] = sim_instance(self.spec, role, tp)
        return self._instances[(role, tp)]

    def _simulate(
        self,
        spec: PlanSpec,
        counts: Mapping[str, int],
        requests: Requests,
        tp: Mapping[str, int] | None = None,
    ):
        """The simulator's run of `requests` on `counts` instances of tensor degree `tp`
        (None: no prefill or no decode capacity)."""
        tp = tp or self.tp
        instances = tuple(
            inst
            for r in self.roles
            for inst in [self._instance(r, tp.get(r, self.tp[r]))] * counts.get(r, 0)
        )
        if not any(i.role in ("decode", "colocated") for i in instances) or not any(
            i.role in ("prefill", "colocated") for i in instances
        ):
            return None
        return simulate(sim_cluster(spec, instances), requests)

    def correct(
        self,
        counts: Mapping[str, int],
        window: list[Sample],
        requests: Requests,
        tp: Mapping[str, int] | None = None,
    ) -> None:
        """Move the correction toward observed/predicted median TTFT (prefill) and TPOT
        (decode) of `window` on `counts` instances of degree `tp`, predicted by the profiled
        model on `requests` (the window's replay at its rate)."""
        result = self._simulate(self._profiled, counts, requests, tp)
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
        counts = {r: view.counts.get(r, 0) for r in self.roles}
        degrees = {r: view.tp.get(r) or self.tp[r] for r in self.roles}
        current = (counts, degrees)  # a placement: (instances, tensor degree) per role

        def decision(action, why, target=current, *more) -> Decision:
            return Decision(action, why, target[0], target[1], *more)

        if view.in_flight:
            return decision("wait", "a change is being applied")
        # A cool-down stops reversals, not a second step the same way: after a scale-up, a
        # further one the evidence asks for goes ahead; every other change waits it out.
        cooling = view.now_s - view.last_change_s < self.config.cooldown_s
        if cooling and view.last_change != "up":
            return decision("hold", "cooling down after the last change")
        window = [s for s in view.samples if s.arrival_s >= view.now_s - self.config.window_s]
        if len(window) < MIN_SAMPLES:
            smallest = self.candidates(degrees)[0]
            idle = view.now_s - view.last_change_s >= self.config.window_s
            if idle and self.devices(*smallest) < self.devices(*current):
                why = f"{len(window)} requests in {self.config.window_s:g} s: idle"
                return decision("scale", why, smallest)
            return decision("hold", f"{len(window)} requests measured: too few to decide")
        # A new phase of the workload is judged from its own requests, once there are enough.
        horizon = view.now_s - self.config.window_s
        arrivals = [a for a in view.arrivals if horizon <= a.arrival_s <= view.now_s]
        shift = latest_shift(arrivals or window)
        phase = ""
        if shift is not None:
            window = [s for s in window if s.arrival_s >= shift.since_s]
            arrivals = [a for a in arrivals if a.arrival_s >= shift.since_s]
            arrived = max(len(arrivals), len(window))
            phase = f"the workload changed {view.now_s - shift.since_s:.3g} s ago ({shift.reason})"
            if arrived < MIN_SAMPLES or len(window) < PHASE_MIN_FINISHED:
                why = (
                    f"{phase}: {arrived} of its requests arrived, {len(window)} finished; "
                    "too few to decide"
                )
                return decision("hold", why)
            phase += ": judged from its requests; "
        rate, requests = _replay(_judged(window, arrivals), self.config.replay)
        rate, surge = self._arrival_rate(view, rate, shift.since_s if shift else -math.inf)
        settled = [s for s in window if s.arrival_s >= view.last_change_s]  # on `current`
        if len(settled) >= MIN_SAMPLES:
            settled_rate, settled_requests = _replay(settled, self.config.replay)
            self.correct(counts, settled, settled_requests.at_rate(settled_rate), degrees)
        slo = self.spec.slo
        # cooling down, what the last placement served is no evidence about this one
        seen = settled if cooling else window
        met = [slo.met(s.ttft_ms / 1000, s.tpot_ms / 1000) for s in seen]
        observed = float(np.mean(met)) if len(seen) >= MIN_SAMPLES else math.nan

        def predict(placement, factor: float) -> float:
            return self.predict(placement[0], requests.at_rate(rate * factor), placement[1])

        alpha = self.spec.alpha
        now = predict(current, 1.0)
        base = {"current": now}
        if now < alpha or observed < alpha:
            ranked = []  # the smallest that meets it at the headroom, else the best at it
            for c in self.candidates(degrees):
                if not self.reachable(current, c):
                    continue
                ranked.append((predict(c, self.config.up_headroom), c))
                if ranked[-1][0] >= alpha:
                    break
            target = max(ranked, key=lambda x: x[0])[1]
            then = predict(target, 1.0)
            predicted = {**base, "target": then}
            why = (
                f"{phase}{surge}SLO at risk at {rate:.3g} req/s (predicted {now:.1%}, observed "
                f"{observed:.1%}, target {alpha:.0%})"
            )
            if target == current or then < now + self.config.margin:
                if not cooling:
                    self._stabilised(view, current, current)  # nothing smaller is safe now
                why += ": no placement in the budget does better"
                return decision("hold", why, current, rate, observed, predicted)
            if cooling and direction(current[0], target[0], current[1], target[1]) != "up":
                why += f"; {_name(target)} would reverse the last scale-up: cooling down"
                return decision("hold", why, current, rate, observed, predicted)
            if cooling:
                why += ", during the cool-down: it continues the last scale-up"
            return decision("scale", why, target, rate, observed, predicted)
        if cooling:
            return decision("hold", "cooling down after the last change", current, rate, observed)
        smallest = next(
            (
                c
                for c in self.candidates(degrees)
                if self.devices(*c) < self.devices(*current)
                and self.reachable(current, c)
                and predict(c, self.config.down_headroom) >= alpha
            ),
            current,
        )
        target = self._stabilised(view, current, smallest)
        if target is None:
            why = "the SLO is met and no smaller placement is safe"
            if smallest != current:
                why = (
                    f"the SLO is met; {self.devices(*smallest)} devices would be, once safe at "
                    f"every decision for {self.config.down_stabilization_s:g} s"
                )
            return decision("hold", why, current, rate, observed, base)
        predicted = {**base, "target": predict(target, 1.0)}
        why = (
            f"{self.devices(*target)} devices have met the SLO at "
            f"{self.config.down_headroom:g}x the measured rate for "
            f"{self.config.down_stabilization_s:g} s (now {rate:.3g} req/s)"
        )
        return decision("scale", why, target, rate, observed, predicted)

    def _stabilised(self, view: View, current: tuple, smallest: tuple) -> tuple | None:
        """Record that `smallest` is the smallest placement safe now; return the placement to
        scale down to, or None. Down is slow (as Kubernetes' HPA stabilises scale-down): to the
        largest of the placements found safe at every decision of the last
        `down_stabilization_s`, and only once the records since the last change (on this
        placement) span that long. One noisy window (a run of short outputs, a lull) then
        cannot take the mesh down just to send it back up. (A placement: (counts, tp).)"""
        stab = self.config.down_stabilization_s
        kept = [
            (t, c)
            for t, c in self._safe
            if self._safe_on == current and view.last_change_s <= t <= view.now_s
        ]
        self._safe_on = current
        self._safe = [*kept[-1000:], (view.now_s, smallest)]
        if self._safe[0][0] > view.now_s - stab:
            return None  # not yet measured for long enough on this placement
        period = [c for t, c in self._safe if t >= view.now_s - stab]
        largest = max(reversed(period), key=lambda c: self.devices(*c))
        return largest if self.devices(*largest) < self.devices(*current) else None

    def _arrival_rate(
        self, view: View, finished_rate: float, since_s: float = -math.inf
    ) -> tuple[float, str]:
        """The arrival rate to decide on (the gateway's reported arrivals' since `since_s`,
        else `finished_rate`; in a surge, the surge's own), and "" or what makes it a surge."""
        config = self.config
        measured = arrival_rate(
            (a.arrival_s for a in view.arrivals),
            view.now_s,
            max(view.arrivals_since_s, since_s),
            config.window_s,
            config.surge,
        )
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


def _judged(finished: list[Sample], arrivals: list[Arrival]) -> list[Sample]:
    """The requests to judge a window by: every finished one, and every arrival not among
    them (still running, or its finish not yet reported) with its own prompt and an output
    length from the finished ones, taken in turn in arrival order. Which arrival is which
    finish: the gateway reports both with the same arrival time and prompt length."""
    if not finished:
        return []
    unmatched = Counter((s.arrival_s, s.prompt_tokens) for s in finished)
    running = []
    for a in arrivals:
        key = (a.arrival_s, a.prompt_tokens)
        if unmatched[key]:
            unmatched[key] -= 1
        else:
            running.append(a)
    outputs = [s.output_tokens for s in sorted(finished, key=lambda s: s.arrival_s)]
    return [
        *finished,
        *(
            Sample(a.arrival_s, a.prompt_tokens, outputs[i % len(outputs)])
            for i, a in enumerate(running)
        ),
    ]


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


def _name(placement: tuple) -> str:
    """A placement ((counts, tp) per role) as a person reads it."""
    counts, tp = placement
    return ", ".join(f"{n} {r}" for r, n in counts.items()) + f" (tp {dict(tp)})"


def _scaled(lat: LatencyModel, prefill: float, decode: float) -> LatencyModel:
    """`lat` corrected by the factors the live mesh measured."""
    return lat.phases_scaled(
        prefill, decode, f"corrected x{prefill:.3g} prefill, x{decode:.3g} decode"
    )
