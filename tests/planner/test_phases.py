"""The running planner across a change of workload (services/planner/autoscale.py), on a fake
clock and views as the mesh would report them (the simulator's TTFT and TPOT): the cool-down
holds a reversal but not a scale-up that continues the last one (`direction`,
services/planner/decision.py); a phase change is seen from the requests' arrivals, before any of
them finishes; and the first step after it goes to the placement the new phase needs, judged
from its own requests (those still running included), not one step toward it."""

from __future__ import annotations

import pytest

from distserve.loadgen.emulated import EmulatedCluster
from services.planner.autoscale import (
    MIN_SAMPLES,
    PHASE_MIN_FINISHED,
    AutoscaleConfig,
    Autoscaler,
    _judged,
)
from services.planner.decision import View, direction
from services.planner.drift import Arrival, Sample
from services.planner.workload import PRESETS
from tests.planner.test_autoscale import BUDGET, NOW, SLO, served

R = 3.8  # bench/planner/autoplan.py's R: 1P1D meets chat's SLO there, not summarisation's
ONE = {"prefill": 1, "decode": 1}


@pytest.fixture(scope="module")
def fresh():
    """A new autoscaler each call (a decision moves its latency correction and records)."""
    spec = EmulatedCluster.of("opt-13b").plan_spec(BUDGET, PRESETS["chat"], SLO)
    return lambda: Autoscaler(spec, dict(ONE), AutoscaleConfig(budget=BUDGET))


def test_which_way_a_change_goes():
    assert direction(ONE, {"prefill": 2, "decode": 1}) == "up"
    assert direction({"prefill": 2, "decode": 1}, {"prefill": 2, "decode": 2}) == "up"
    assert direction({"prefill": 5, "decode": 1}, {"prefill": 3, "decode": 1}) == "down"
    assert direction({"prefill": 5, "decode": 1}, {"prefill": 2, "decode": 2}) == "reshape"
    assert direction(ONE, ONE, {"prefill": 1}, {"prefill": 2}) == "reshape"  # a re-shard
    assert direction(ONE, dict(ONE)) == ""


def test_a_scale_up_that_continues_the_last_is_not_held_by_the_cool_down(fresh):
    """1P1D went to 2P1D 10 s ago on summarisation at R; the phase's requests (all served
    before the change) say 2P1D is not enough: a further scale-up goes ahead in the cool-down.
    After a scale-down or a reshape the same evidence waits the cool-down out."""
    a = fresh()
    two = {"prefill": 2, "decode": 1}
    samples = served(a, ONE, "summarization", R, 11, n=240, end=NOW - 10)
    arrivals = tuple(Arrival(s.arrival_s, s.prompt_tokens) for s in samples)

    def view(last_change: str) -> View:
        return View(
            NOW, samples, two, last_change_s=NOW - 10, last_change=last_change,
            arrivals=arrivals, arrivals_since_s=0.0,
        )  # fmt: skip

    d = fresh().decide(view("up"))
    assert d.action == "scale" and direction(two, d.counts) == "up", d
    assert d.predicted["target"] >= 0.9 > d.predicted["current"], d
    assert "continues the last scale-up" in d.reason, d
    for other in ("down", "reshape", ""):
        held = fresh().decide(view(other))
        assert (held.action, held.counts) == ("hold", two), (other, held)


def test_a_reversal_is_held_by_the_cool_down_and_taken_after_it(fresh):
    """5P1D, 10 s after a scale-up; the load is now chat at 2R, which wants decode: the up
    rule's placement (2P2D) takes prefill away, a reversal, held until the cool-down ends. A
    load that would let the mesh shrink is held in the cool-down too."""
    a = fresh()
    five = {"prefill": 5, "decode": 1}
    samples = served(a, five, "chat", 2 * R, 3, n=400)
    cooling = fresh().decide(View(NOW, samples, five, last_change_s=NOW - 10, last_change="up"))
    assert (cooling.action, cooling.counts) == ("hold", five), cooling
    assert "would reverse the last scale-up" in cooling.reason, cooling
    after = fresh().decide(View(NOW, samples, five, last_change_s=NOW - 40, last_change="up"))
    assert after.action == "scale" and direction(five, after.counts) == "reshape", after
    big = {"prefill": 4, "decode": 4}
    light = served(a, big, "chat", 1.0, 3, n=100)
    d = fresh().decide(View(NOW, light, big, last_change_s=NOW - 10, last_change="up"))
    assert (d.action, d.counts) == ("hold", big), d


def arrivals_of(samples) -> list[Arrival]:
    """The gateway's arrival reports of these requests."""
    return [Arrival(s.arrival_s, s.prompt_tokens) for s in samples]


def test_a_phase_change_is_seen_from_arrivals_before_any_of_its_requests_finishes(fresh):
    """Chat at R on 1P1D, its requests finished; then summarisation's first requests arrive
    and none has finished. The planner sees the change from their prompt lengths at arrival
    (within 12 of them) and holds for the phase's own requests, naming it, instead of deciding
    on the chat window."""
    a = fresh()
    chat = served(a, ONE, "chat", R, 0, n=200, end=NOW - 10)
    summ = served(a, ONE, "summarization", R, 11, n=12, end=NOW)
    view = View(
        NOW, chat, ONE, last_change_s=0.0,
        arrivals=tuple(arrivals_of(chat + summ)), arrivals_since_s=0.0,
    )  # fmt: skip
    d = fresh().decide(view)
    assert d.action == "hold" and "the workload changed" in d.reason, d
    assert "12 of its requests arrived, 0 finished" in d.reason, d
    # without the arrivals' prompt lengths, the finished chat requests show no change
    blind = fresh().decide(View(NOW, chat, ONE, last_change_s=0.0))
    assert "the workload changed" not in blind.reason, blind


def test_the_first_step_after_a_phase_change_goes_to_the_phase_s_placement(fresh):
    """Chat at R on 1P1D, then summarisation at R. Decisions as its requests finish (each
    ~3 s after it arrives; arrivals reported at once): none is taken on the mix of the two
    phases (that took 1P1D -> 2P1D, then waited out the cool-down for the rest); the first,
    once MIN_SAMPLES of the new phase have arrived and PHASE_MIN_FINISHED finished (before
    MIN_SAMPLES have finished), goes where a window of summarisation alone takes the mesh."""
    a = fresh()
    target = fresh().decide(View(NOW, served(a, ONE, "summarization", R, 0, n=240), ONE))
    assert target.action == "scale", target
    start = NOW - 30
    chat = served(a, ONE, "chat", R, 0, n=200, end=start)
    summ = served(a, ONE, "summarization", R, 11, n=60, end=start + 60 / R)
    arrivals = arrivals_of(chat + summ)
    b = fresh()
    for k in range(1, len(summ)):
        window = chat + summ[:k]
        now = window[-1].arrival_s + 3.0
        seen = tuple(x for x in arrivals if x.arrival_s <= now)
        d = b.decide(View(now, window, ONE, last_change_s=0.0, arrivals=seen, arrivals_since_s=0.0))
        if d.action == "scale":
            break
        assert d.action == "hold", (k, d)
    assert PHASE_MIN_FINISHED <= k < MIN_SAMPLES and "judged from its requests" in d.reason, (k, d)
    assert d.counts == target.counts, (d, target)


def test_requests_still_running_are_judged_with_the_finished():
    """The replay takes every arrival: a finished request as measured, one still running with
    its own prompt and an output length taken in turn from the finished ones."""
    finished = [Sample(1.0, 100, 7, 50.0, 20.0), Sample(2.0, 200, 9, 50.0, 20.0)]
    running = [Arrival(3.0, 1800), Arrival(4.0, 1700), Arrival(5.0, 1600)]
    judged = _judged(finished, arrivals_of(finished) + running)
    assert judged[:2] == finished
    assert [(s.arrival_s, s.prompt_tokens, s.output_tokens) for s in judged[2:]] == [
        (3.0, 1800, 7),
        (4.0, 1700, 9),
        (5.0, 1600, 7),
    ]
    assert _judged(finished, []) == finished  # no arrivals reported: the finished alone
