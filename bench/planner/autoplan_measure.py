"""What bench/planner/autoplan.py measures a run by: its schedule of workload segments, a log of
what the launcher's actuator was asked and did, and the figures (attainment per segment after a
settling window, settle time, lost requests) read from a run's `LoadResult`.

Times are emulated seconds from the start of the run (the load generator's clock; the
actuator's events are taken on the wall and divided by the time scale).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from distserve.loadgen.results import LoadResult
from services.common.errors import FailedPrecondition
from services.common.slo import Slo
from services.planner.autoscale import AutoscaleConfig
from services.planner.surge import arrival_rate
from services.planner.workload import PRESETS, Requests

SETTLED = 0.9  # attainment that counts as settled (the planner's target)


@dataclass(frozen=True)
class Segment:
    """`workload` at `rate` requests/s for `length_s` emulated seconds."""

    name: str
    workload: str
    rate: float
    length_s: float


def schedule(segments: list[Segment], seed: int) -> tuple[Requests, list[tuple[float, float]]]:
    """The requests of the segments one after the other (Poisson arrivals, the workload's
    lengths) and each segment's [start, end) in emulated seconds."""
    arrivals, prompts, outputs, spans = [], [], [], []
    start = 0.0
    for i, seg in enumerate(segments):
        n = int(seg.rate * seg.length_s * 1.5) + 50  # more than the span needs
        r = PRESETS[seg.workload].sample(n, seed + i).at_rate(seg.rate)
        keep = r.arrival_s < seg.length_s
        arrivals.append(start + r.arrival_s[keep])
        prompts.append(r.prompt[keep])
        outputs.append(r.output[keep])
        spans.append((start, start + seg.length_s))
        start += seg.length_s
    requests = Requests(np.concatenate(arrivals), np.concatenate(prompts), np.concatenate(outputs))
    return requests, spans


def surge_test_s(
    arrivals: np.ndarray, start: float, config: AutoscaleConfig, within_s: float = 60.0
) -> float | None:
    """Seconds from `start` until the planner's surge test flags the scheduled `arrivals`
    (tested every 0.05 s, no mesh: what the statistic alone needs on this burst's arrivals);
    None: not within `within_s`."""
    arrivals = np.sort(arrivals)
    for t in np.arange(start, start + within_s, 0.05):
        measured = arrival_rate(
            arrivals[arrivals <= t].tolist(), t, 0.0, config.window_s, config.surge
        )
        if measured is not None and measured[1] is not None:
            return round(float(t - start), 2)
    return None


def attainment_in(result: LoadResult, slo: Slo, start: float, end: float) -> float | None:
    """SLO attainment of the requests that arrived in [start, end) (None: none did)."""
    inside = (result.arrival_s >= start) & (result.arrival_s < end)
    return round(float(result.met(slo)[inside].mean()), 4) if inside.any() else None


def settle_s(result: LoadResult, slo: Slo, start: float, end: float, step: float = 5.0):
    """Emulated seconds from `start` (a change of workload) until the attainment of every
    request arriving from then to `end` is back over SETTLED (None: not within the segment)."""
    met = result.met(slo)
    for t in np.arange(start, end, step):
        inside = (result.arrival_s >= t) & (result.arrival_s < end)
        if inside.sum() >= 10 and met[inside].mean() >= SETTLED:
            return round(float(t - start), 1)
    return None


def lost(result: LoadResult) -> int:
    """Requests that did not end with all their tokens (failed, or cut short)."""
    whole = result.ok & (result.output_tokens == result.expected_tokens)
    return int((~whole).sum())


@dataclass
class Event:
    t_s: float  # emulated seconds from the run's start
    kind: str  # "asked" (an Apply arrived), "refused" (one was in flight), "landed"
    counts: dict[str, int] = field(default_factory=dict)


class ActuatorLog:
    """Records what the planner asked the launcher's `LocalActuator` (each Apply, and whether
    it came while a change was being applied) and when each change landed. Wraps the
    actuator's `apply_in_background` (what the Actuator service calls) and polls `status()`."""

    def __init__(self, actuator, time_scale: float) -> None:
        self.actuator, self.time_scale = actuator, time_scale
        self.events: list[Event] = []
        self._t0 = time.perf_counter()
        self._stop = threading.Event()
        inner = actuator.apply_in_background

        def apply_in_background(pool, counts, reason="", tp=None):
            try:
                inner(pool, counts, reason, tp)
            except FailedPrecondition:  # a change is being applied: refused
                self.events.append(Event(self.now(), "refused", dict(counts)))
                raise
            self.events.append(Event(self.now(), "asked", dict(counts)))

        actuator.apply_in_background = apply_in_background
        self._watcher = threading.Thread(target=self._watch, daemon=True)
        self._watcher.start()

    def start(self) -> None:
        """The run starts now: event times are measured from here."""
        self._t0 = time.perf_counter()
        self.events.clear()

    def now(self) -> float:
        return (time.perf_counter() - self._t0) / self.time_scale

    def close(self) -> None:
        self._stop.set()
        self._watcher.join()

    def _watch(self) -> None:
        was = False
        while not self._stop.wait(0.05):
            status = self.actuator.status()
            if was and not status.changing:
                roles = {i.role for i in status.instances}
                counts = {r: status.count(r) for r in sorted(roles)}
                self.events.append(Event(self.now(), "landed", counts))
            was = status.changing

    def asked(self, start: float = 0.0, end: float = math.inf) -> list[Event]:
        return [e for e in self.events if e.kind == "asked" and start <= e.t_s < end]

    def refused(self) -> int:
        return sum(1 for e in self.events if e.kind == "refused")

    def to_json(self) -> list[dict]:
        return [{"t_s": round(e.t_s, 2), "kind": e.kind, "counts": e.counts} for e in self.events]
