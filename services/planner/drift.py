"""Drift detection: has the workload moved far enough from what the placement was planned for?

Samples (one per finished request, from the gateway) are cut into windows of `window` requests.
Each full window's arrival rate and mean prompt and output lengths are compared with the
reference, the workload the current placement was planned for. A window *drifts* when any of
them is off by more than its threshold, measured symmetrically (|ln(now / reference)| >
ln(1 + threshold), so +30% and -23% are the same distance).

Hysteresis, so the planner does not oscillate:
* a proposal needs `confirm` drifting windows in a row, and their pooled samples must drift
  too: one noisy window never replans;
* on a proposal the reference moves to the new level (the pooled windows): the workload must
  move a full threshold from there to trigger again, so noise around the new level stays quiet;
* a drifting window followed by a quiet one starts the count again.
With no reference yet, the first `confirm` windows, pooled, become it.

`latest_shift` answers a faster question for the resizing planner (services/planner/autoscale.py):
within the window it decides on, where did the requests' lengths change, so that a new phase
is judged from its own requests and not from a mix with the last one's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from services.common.errors import InvalidRequest

# `latest_shift`: the evidence a split of the window must show (the pooled two-sample t statistic
# of mean log prompt length), and the fewest requests on each side. Over windows of one unchanging
# workload (the presets, ~230 requests) the largest split stays near 2.4 (median); the planner
# tests a sliding window of arrivals every second, and over 3 hours of chat at 3.8 req/s the
# largest of those was 4.9 (4.5 was passed at 0.06% of ticks: a false phase now and then). A
# shift from chat to summarisation passes 5.5 within 12 (median; at most 14 of 40 draws) of the
# new phase's arrivals (tests/planner/test_drift.py holds both).
SHIFT_EVIDENCE = 5.5
SHIFT_MIN_BEFORE = 20
SHIFT_MIN_AFTER = 5


@dataclass(frozen=True)
class Sample:
    """One request as the gateway saw it."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1 or not math.isfinite(self.arrival_s):
            raise InvalidRequest(
                "a workload sample needs a finite arrival time and prompt and output token "
                f"counts >= 1, got {self.arrival_s}, {self.prompt_tokens}, {self.output_tokens}"
            )


class Arrival(NamedTuple):
    """A request as the gateway accepted it: when, and its prompt's length (both known then;
    its output length only when it finishes, as a `Sample`)."""

    arrival_s: float
    prompt_tokens: int


@dataclass(frozen=True)
class WorkloadStats:
    """What a window of samples looks like: arrivals per second and mean lengths in tokens."""

    rate: float
    mean_prompt: float
    mean_output: float
    samples: int

    @classmethod
    def of(cls, samples: list[Sample]) -> WorkloadStats:
        times = sorted(s.arrival_s for s in samples)
        span = times[-1] - times[0]
        rate = (len(times) - 1) / span if span > 0 else math.inf
        return cls(
            rate=rate,
            mean_prompt=sum(s.prompt_tokens for s in samples) / len(samples),
            mean_output=sum(s.output_tokens for s in samples) / len(samples),
            samples=len(samples),
        )


@dataclass(frozen=True)
class DriftConfig:
    window: int = 200  # samples per window
    rate_shift: float = 0.3  # relative change of the arrival rate that counts as drift
    length_shift: float = 0.25  # relative change of a mean length that counts as drift
    confirm: int = 2  # drifting windows in a row before proposing a new placement

    def __post_init__(self) -> None:
        if self.window < 2 or self.confirm < 1 or self.rate_shift <= 0 or self.length_shift <= 0:
            raise InvalidRequest("drift: window >= 2, confirm >= 1 and thresholds > 0")


@dataclass(frozen=True)
class Drift:
    """A confirmed shift: from the reference to the level now, and what moved."""

    reference: WorkloadStats
    now: WorkloadStats
    reasons: tuple[str, ...]
    window: tuple[Sample, ...]  # the confirming windows: a trace of the new workload


class DriftDetector:
    """Feeds on samples; returns a Drift when a shift is confirmed (then re-anchors)."""

    def __init__(self, config: DriftConfig, reference: WorkloadStats | None = None) -> None:
        self.config = config
        self.reference = reference
        self.window: list[Sample] = []
        self.pooled: list[Sample] = []  # the drifting windows so far (or the first ones)
        self.strikes = 0

    def observe(self, sample: Sample) -> Drift | None:
        self.window.append(sample)
        if len(self.window) < self.config.window:
            return None
        window, self.window = self.window, []
        self.pooled += window
        if self.reference is None:
            if len(self.pooled) >= self.config.confirm * self.config.window:
                self.reference, self.pooled = WorkloadStats.of(self.pooled), []
            return None
        if not self.shifts(WorkloadStats.of(window)):
            self.strikes, self.pooled = 0, []
            return None
        self.strikes += 1
        if self.strikes < self.config.confirm:
            return None
        now = WorkloadStats.of(self.pooled)
        reasons = self.shifts(now)
        pooled, self.pooled, self.strikes = self.pooled, [], 0
        if not reasons:  # each window drifted, their pool does not: noise, not a shift
            return None
        drift = Drift(self.reference, now, reasons, tuple(pooled))
        self.reference = now
        return drift

    def shifts(self, now: WorkloadStats) -> tuple[str, ...]:
        ref, c = self.reference, self.config
        checks = (
            ("rate", ref.rate, now.rate, c.rate_shift),
            ("prompt length", ref.mean_prompt, now.mean_prompt, c.length_shift),
            ("output length", ref.mean_output, now.mean_output, c.length_shift),
        )
        return tuple(
            f"{name} {before:.3g} -> {after:.3g}"
            for name, before, after, limit in checks
            if abs(math.log(after / before)) > math.log(1 + limit)
        )


@dataclass(frozen=True)
class Shift:
    """The window's requests changed lengths: from the one that arrived at `since_s` on."""

    since_s: float
    reason: str  # what changed: the geometric mean prompt length before and after


def latest_shift(window: Sequence[Sample | Arrival]) -> Shift | None:
    """Where in `window` (any order; judged in arrival order) the requests' prompt lengths
    changed: the split that best separates the mean log prompt length before it from after it
    (a pooled two-sample t statistic, at least SHIFT_MIN_BEFORE / SHIFT_MIN_AFTER requests each
    side), if its evidence passes SHIFT_EVIDENCE; else None. Log lengths, because lengths are
    skewed (lognormal-like) and a phase change multiplies them. The running planner passes the
    arrivals (a prompt's length is known when the gateway accepts it), so a new phase is seen
    within ~10 of its requests, before any has finished. Not output lengths: those come only
    with a finish, so the newest finished requests are the short ones (the long ones that
    arrived with them are still running), and that alone would look like a shift."""
    window = sorted(window, key=lambda s: s.arrival_s)
    n = len(window)
    if n < SHIFT_MIN_BEFORE + SHIFT_MIN_AFTER:
        return None
    x = np.log([s.prompt_tokens for s in window])
    k = np.arange(SHIFT_MIN_BEFORE, n - SHIFT_MIN_AFTER + 1)  # requests before each split
    cum, cum2 = np.cumsum(x)[k - 1], np.cumsum(x**2)[k - 1]
    mean_a, mean_b = cum / k, (x.sum() - cum) / (n - k)
    within = cum2 - k * mean_a**2 + ((x**2).sum() - cum2) - (n - k) * mean_b**2
    sd = np.sqrt(np.maximum(within, 0) / (n - 2))
    t = np.abs(mean_a - mean_b) / np.maximum(sd * np.sqrt(1 / k + 1 / (n - k)), 1e-12)
    best = int(np.argmax(t))
    if t[best] <= SHIFT_EVIDENCE:
        return None
    split = int(k[best])
    before, after = np.exp(x[:split].mean()), np.exp(x[split:].mean())
    return Shift(window[split].arrival_s, f"prompts {before:.3g} -> {after:.3g} tokens")
