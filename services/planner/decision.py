"""What the autoscaler decides from (`View`: what the planner sees now) and what it decides
(`Decision`), apart from how it decides (services/planner/autoscale.py). `Decision.to_pb` is
the one place a decision becomes the `Decision` message that GetDecision answers (`distserve
plan --watch`); the generated stubs are imported only there, so the deciding stays importable
without them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.planner.drift import Arrival, Sample

if TYPE_CHECKING:
    from services.common.gen.distserve.v1 import common_pb2, planner_pb2


@dataclass(frozen=True)
class View:
    """What the planner sees now."""

    now_s: float
    samples: tuple[Sample, ...]  # finished requests, in the order they finished (any age)
    counts: Mapping[str, int]  # instances per role now (the registry's view)
    tp: Mapping[str, int] = field(default_factory=dict)  # each role's degree (not named: as built)
    in_flight: bool = False  # a change is being applied
    last_change_s: float = -math.inf  # when the last change landed
    last_change: str = ""  # its `direction` ("up", "down", "reshape"; "": none, or the start)
    # the requests the gateway accepted (when, and their prompt lengths; it reports each as it
    # is accepted), counted since `arrivals_since_s`; none reported: the rate and the lengths
    # are measured from the finished requests alone
    arrivals: tuple[Arrival, ...] = ()
    arrivals_since_s: float = -math.inf


def direction(
    before: Mapping[str, int],
    after: Mapping[str, int],
    before_tp: Mapping[str, int] | None = None,
    after_tp: Mapping[str, int] | None = None,
) -> str:
    """Which way a change of placement goes, from `before` to `after` instances per role
    (of tensor degree `before_tp` / `after_tp`, a role not named: unchanged): "up" when no
    role has fewer instances and some role has more; "down" the mirror; "reshape" when some
    role gains and another loses, or a role is re-sharded (its instances replaced); "" when
    nothing changes. The cool-down (services/planner/autoscale.py) lets an "up" follow an
    "up" and holds every other change: it stops reversals, not a second step the same way."""
    roles = set(before) | set(after)
    before_tp, after_tp = before_tp or {}, after_tp or {}
    if any(before_tp.get(r, after_tp.get(r)) != after_tp.get(r, before_tp.get(r)) for r in roles):
        return "reshape"
    more = any(after.get(r, 0) > before.get(r, 0) for r in roles)
    fewer = any(after.get(r, 0) < before.get(r, 0) for r in roles)
    return {(True, False): "up", (False, True): "down", (True, True): "reshape"}.get(
        (more, fewer), ""
    )


@dataclass(frozen=True)
class Decision:
    action: str  # "scale", "hold" or "wait"
    reason: str
    counts: dict[str, int]  # the target (the current counts unless action is "scale")
    tp: dict[str, int] = field(default_factory=dict)  # the target's tensor degree per role
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
            "tp": self.tp,
            "rate_rps": round(float(self.rate), 4),
            "observed_attainment": None if math.isnan(self.observed) else round(self.observed, 4),
            "predicted_attainment": {k: round(v, 4) for k, v in self.predicted.items()},
            "latency_correction": {k: round(v, 4) for k, v in self.correction.items()},
        }

    def to_pb(
        self,
        current: Mapping[str, int],
        current_tp: Mapping[str, int],
        *,
        samples: int,
        decided_unix_s: float,
        advisory: bool,
        budget: int,
        load: Mapping[str, common_pb2.WorkerLoad],
    ) -> planner_pb2.Decision:
        """The message, with what the decision was taken on: `current` instances of degree
        `current_tp` per role, `samples` finished requests in the window, each role's `load`."""
        from services.common.gen.distserve.v1 import planner_pb2

        return planner_pb2.Decision(
            action=self.action,
            reason=self.reason,
            current=dict(current),
            target=self.counts,
            current_tp=dict(current_tp),
            target_tp=self.tp,
            rate_rps=self.rate,
            observed_attainment=-1.0 if math.isnan(self.observed) else self.observed,
            predicted_attainment=self.predicted,
            decided_unix_s=decided_unix_s,
            advisory=advisory,
            budget=budget,
            samples=samples,
            load=dict(load),
        )
