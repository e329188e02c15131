"""Drift detection: a real shift proposes once; noise within thresholds does not; no flapping.
`latest_shift`: where in the planner's window a new phase's prompt lengths began, and no split
in a window of one workload."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import InvalidRequest
from services.planner.drift import DriftConfig, DriftDetector, Sample, latest_shift
from services.planner.workload import PRESETS

WINDOW = 100


class Stream:
    """Poisson arrivals whose rate and lengths can change between windows."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.t = 0.0

    def window(self, rate: float, prompt: int = 500, output: int = 100) -> list[Sample]:
        out = []
        for _ in range(WINDOW):
            self.t += self.rng.exponential(1 / rate)
            p = max(1, int(self.rng.normal(prompt, prompt * 0.3)))
            o = max(1, int(self.rng.normal(output, output * 0.3)))
            out.append(Sample(self.t, p, o))
        return out


def run(detector: DriftDetector, windows: list[list[Sample]]) -> list:
    return [d for w in windows for s in w if (d := detector.observe(s)) is not None]


def detector() -> DriftDetector:
    return DriftDetector(DriftConfig(window=WINDOW, rate_shift=0.3, length_shift=0.25, confirm=2))


def test_a_sustained_rate_shift_proposes_once():
    s = Stream()
    drifts = run(detector(), [s.window(10) for _ in range(3)] + [s.window(20) for _ in range(6)])
    assert len(drifts) == 1
    assert drifts[0].reasons[0].startswith("rate")
    assert drifts[0].now.rate == pytest.approx(20, rel=0.25)
    assert len(drifts[0].window) == 2 * WINDOW  # the two confirming windows


def test_length_shifts_are_drift_too():
    s = Stream()
    windows = [s.window(10) for _ in range(2)] + [s.window(10, prompt=900) for _ in range(3)]
    drifts = run(detector(), windows)
    assert len(drifts) == 1 and drifts[0].reasons == (drifts[0].reasons[0],)
    assert drifts[0].reasons[0].startswith("prompt length")


def test_noise_within_thresholds_never_proposes():
    s = Stream(1)
    rates = [10, 11, 9.5, 10.5, 9, 11.5, 10, 9.8, 10.7, 9.3]
    assert run(detector(), [s.window(r) for r in rates]) == []


def test_a_single_spike_is_not_confirmed():
    s = Stream(2)
    windows = [s.window(10), s.window(10), s.window(25), s.window(10), s.window(10)]
    assert run(detector(), windows) == []


def test_alternating_near_the_threshold_does_not_flap():
    """A workload that alternates between two levels a threshold apart, window by window,
    never confirms; after a real shift, noise around the new level stays quiet."""
    alternating = [Stream(3).window(r) for r in [10, 15] * 5]
    # without confirmation the same stream flaps: the hysteresis is what keeps it quiet
    eager = DriftDetector(DriftConfig(window=WINDOW, rate_shift=0.3, confirm=1))
    assert len(run(eager, alternating)) > 2
    s = Stream(3)
    d = detector()
    assert run(d, [s.window(r) for r in [10, 15] * 5]) == []
    drifts = run(d, [s.window(20) for _ in range(3)] + [s.window(r) for r in [18, 22] * 5])
    assert len(drifts) == 1


def test_a_return_to_the_old_level_is_a_new_drift():
    s = Stream(4)
    d = detector()
    drifts = run(d, [s.window(r) for r in (10, 10, 20, 20, 20, 10, 10, 10)])
    assert len(drifts) == 2  # up, then back down: each confirmed once


def test_bad_samples_and_configs_are_clear_errors():
    with pytest.raises(InvalidRequest, match="token counts >= 1"):
        Sample(0.0, 0, 5)
    with pytest.raises(InvalidRequest, match="window >= 2"):
        DriftConfig(window=1)


def preset_window(name: str, n: int, seed: int, start: float = 0.0) -> list[Sample]:
    """`n` requests of a workload preset at 1 request/s from `start`."""
    r = PRESETS[name].sample(n, seed)
    return [
        Sample(start + float(t), int(p), int(o))
        for t, p, o in zip(r.arrival_s, r.prompt, r.output, strict=True)
    ]


def test_a_window_of_one_workload_shows_no_shift():
    """300 windows of each preset, ~4 minutes of requests at 1/s each: no split is taken for
    a change (what the new phase's requests are judged from would be a random part)."""
    for name in ("chat", "code", "summarization"):
        for seed in range(300):
            assert latest_shift(preset_window(name, 230, seed)) is None, (name, seed)


def test_a_change_of_prompt_lengths_is_found_where_it_began():
    """Chat, then summarisation's longer prompts: found within 15 of the new requests, at
    the first of them (give or take a long chat prompt just before). Back from summarisation
    to chat: within 8."""
    for seed in range(20):
        chat = preset_window("chat", 200, seed)
        summ = preset_window("summarization", 15, 100 + seed, start=chat[-1].arrival_s + 1)
        shift = latest_shift(chat + summ)
        assert shift is not None, seed
        first = summ[0].arrival_s
        assert shift.since_s in [s.arrival_s for s in (chat[-5:] + summ[:1])], (seed, shift)
        assert shift.since_s <= first and "prompts" in shift.reason
        later = preset_window("summarization", 200, seed)
        back = preset_window("chat", 8, 200 + seed, start=later[-1].arrival_s + 1)
        assert latest_shift(later + back) is not None, seed


def test_the_newest_requests_finishing_short_is_no_shift():
    """A request is reported when it finishes: the window's newest requests are the short
    ones (the long ones that came with them still run). Their output lengths must not read
    as a new workload."""
    for seed in range(20):
        window = preset_window("chat", 260, seed)
        newest = window[-60:]
        finished = window[:-60] + [s for s in newest if s.output_tokens < 60]
        assert len(finished) < len(window)
        assert latest_shift(finished) is None, seed
