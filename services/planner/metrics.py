"""The planner's Prometheus metrics: what it was told of the live workload and what it decided.

Placements are counted by why they were made (`plan`: a Plan call; `drift`: the live workload
drifted), and the current one is described by gauges: its version, its predicted goodput per
device, and its instances per role, so a dashboard shows when and how the split changed.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.metrics import PHASE_BUCKETS
from services.planner.replanner import Current


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.samples = Counter(
            "distserve_planner_workload_samples",
            "Finished requests the gateway reported (ReportWorkload).",
            registry=registry,
        )
        self.drifts = Counter(
            "distserve_planner_drifts",
            "Confirmed drifts of the live workload (rate or lengths beyond the thresholds).",
            registry=registry,
        )
        self.placements = Counter(
            "distserve_planner_placements",
            "Placements adopted, by reason (plan: a Plan call; drift: the workload drifted).",
            ["reason"],
            registry=registry,
        )
        self.search = Histogram(
            "distserve_planner_search_seconds",
            "Wall time of a placement search.",
            buckets=PHASE_BUCKETS,
            registry=registry,
        )
        self.version = Gauge(
            "distserve_planner_placement_version",
            "Version of the current placement (0: none yet).",
            registry=registry,
        )
        self.goodput = Gauge(
            "distserve_planner_goodput_per_device_rps",
            "Per-device goodput the simulator predicts for the current placement.",
            registry=registry,
        )
        self.instances = Gauge(
            "distserve_planner_instances",
            "Instances of the current placement, by role.",
            ["role"],
            registry=registry,
        )
        self.leader = Gauge(
            "distserve_planner_leader",
            "1 on the planner replica that decides and acts, 0 on a standby (--etcd).",
            registry=registry,
        )
        self.leader.set(1)  # alone (no --etcd), a planner leads
        self._roles: set[str] = set()  # reported so far: a role a new placement drops goes to 0

    def adopted(self, current: Current, seconds: float) -> None:
        """A placement became current after a search of `seconds`."""
        self.placements.labels("drift" if current.reason.startswith("drift") else "plan").inc()
        self.search.observe(seconds)
        self.version.set(current.version)
        self.goodput.set(current.placement.per_device)
        roles = [instance.role for instance in current.placement.instances]
        self._roles.update(roles)
        for role in self._roles:
            self.instances.labels(role).set(roles.count(role))
