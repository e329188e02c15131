"""The planner service's state: the current placement, and replanning when the workload drifts.

It moves no instance: the running mesh is resized by the `Autoscaler` (autoscale.py, through
control.py's loop and an actuator). It stays for what the autoscaler does not do: the whole
placement the planner recommends (parallelism per phase, replicas, node mapping), searched
anew when the workload drifts and answered by Plan, GetPlacement and each ReportWorkload
reply (the gateway's feed logs it and exports its version), so an operator sees when the
deployed shape no longer fits; the autoscaler only changes instance counts and tensor
degrees within a budget.

Plans are searched on worker threads (a search takes seconds) so the gRPC event loop keeps
taking samples. A replan uses the drifted window itself as the workload (a trace), at its
measured rate when the current plan has a target rate; on a single host it re-splits the workers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np

from services.common.errors import NotFound
from services.planner.drift import Drift, DriftConfig, DriftDetector, Sample
from services.planner.placement import Placement, Plan, PlanSpec, plan, split_workers
from services.planner.workload import TraceWorkload


@dataclass(frozen=True)
class Current:
    """A placement with its version and the reason it was made."""

    placement: Placement
    version: int
    reason: str


class Replanner:
    """Holds the current placement and the spec it came from; replans on confirmed drift."""

    def __init__(self, drift: DriftConfig, workers: int = 0) -> None:
        self.detector = DriftDetector(drift)
        self.workers = workers  # > 0: a single host of this many one-device workers
        self.spec: PlanSpec | None = None
        self.current: Current | None = None
        self._versions = itertools.count(1)
        self._lock = asyncio.Lock()

    async def plan(self, spec: PlanSpec) -> tuple[Plan | None, Current]:
        """Search a placement for the spec (off the event loop); it becomes current."""
        async with self._lock:
            if self.workers:
                placement = await asyncio.to_thread(split_workers, spec, self.workers)
                result = None
            else:
                result = await asyncio.to_thread(plan, spec)
                placement = result.placement
            self.spec = spec
            # The live workload's next window becomes the reference for this plan.
            self.detector = DriftDetector(self.detector.config)
            return result, self._adopt(placement, "plan")

    def observe(self, sample: Sample) -> Drift | None:
        return self.detector.observe(sample)

    async def replan(self, drift: Drift) -> Current | None:
        """A new placement for the drifted workload; None when nothing was planned yet."""
        if self.spec is None:
            return None
        trace = TraceWorkload(
            name="drifted window",
            arrival_s=np.array([s.arrival_s for s in drift.window]) - drift.window[0].arrival_s,
            prompt=np.array([s.prompt_tokens for s in drift.window]),
            output=np.array([s.output_tokens for s in drift.window]),
        )
        rate = drift.now.rate if self.spec.rate is not None else None
        spec = dataclasses.replace(self.spec, workload=trace, rate=rate)
        async with self._lock:
            if self.workers:
                placement = await asyncio.to_thread(split_workers, spec, self.workers)
            else:
                placement = (await asyncio.to_thread(plan, spec)).placement
            self.spec = spec
            return self._adopt(placement, "drift: " + "; ".join(drift.reasons))

    def placement(self) -> Current:
        if self.current is None:
            raise NotFound("no placement yet: call Plan first")
        return self.current

    def _adopt(self, placement: Placement, reason: str) -> Current:
        self.current = Current(placement, next(self._versions), reason)
        return self.current
