"""Worker pools from a planner placement: the instances grouped per role (and per node in low
affinity), validated against what a pod can run."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from services.common.errors import InvalidRequest

WORKER_ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class WorkerPool:
    """The instances of one role and shape; `node` is the plan node they are pinned to (low
    affinity), None where the scheduler chooses."""

    role: str
    tp: int
    pp: int
    replicas: int
    node: int | None = None

    @property
    def name(self) -> str:
        return f"distserve-{self.role}" + ("" if self.node is None else f"-node{self.node}")

    @property
    def node_group(self) -> str | None:
        return None if self.node is None else f"node-{self.node}"


def select_placement(plan: dict, baseline: bool = False) -> dict:
    """The placement to deploy: the plan's own, or its colocated baseline's."""
    if not isinstance(plan, dict):
        raise InvalidRequest("a placement file holds one JSON object (`distserve plan` output)")
    if "instances" in plan and not baseline:
        return plan  # a bare placement (Placement.to_json)
    key = "colocated" if baseline else "placement"
    if not isinstance(plan.get(key), dict):
        raise InvalidRequest(f"not a plan: it has no {key!r} object (use `distserve plan` output)")
    return plan[key]


def worker_pools(placement: dict, gpus_per_node: int | None = None) -> list[WorkerPool]:
    """The placement's instances grouped into pools: per role, and per node in low affinity."""
    instances = placement.get("instances")
    if not isinstance(instances, list) or not instances:
        raise InvalidRequest("the placement has no instances")
    pinned = placement.get("algorithm") == "low-affinity"
    shapes: dict[tuple[str, int], tuple[int, int]] = {}
    counts: Counter[tuple[str, int]] = Counter()
    for i, inst in enumerate(instances):
        role, tp, pp, nodes = _instance(i, inst)
        where = f"instance {i} ({role}, tp={tp}, pp={pp})"
        if gpus_per_node is not None and tp * pp > gpus_per_node:
            raise InvalidRequest(
                f"{where} needs {tp * pp} GPUs in one pod, more than a node's {gpus_per_node}"
            )
        if pp > 1:
            raise InvalidRequest(
                f"{where}: the workers implement tensor parallelism only, not pipeline "
                "parallelism; plan with `distserve plan --max-pp 1` (the default)"
            )
        key = (role, nodes[0] if pinned else -1)
        if shapes.setdefault(key, (tp, pp)) != (tp, pp):
            raise InvalidRequest(f"{where}: the {role} instances differ in tp or pp")
        counts[key] += 1
    for role, phase in (placement.get("phases") or {}).items():
        placed = sum(n for (r, _), n in counts.items() if r == role)
        if isinstance(phase, dict) and phase.get("replicas") != placed:
            raise InvalidRequest(
                f"the placement's {role} phase says {phase.get('replicas')} replicas, "
                f"its instances {placed}"
            )
    order = sorted(counts, key=lambda k: (WORKER_ROLES.index(k[0]), k[1]))
    return [
        WorkerPool(role, *shapes[(role, node)], counts[(role, node)], None if node < 0 else node)
        for role, node in order
    ]


def _instance(i: int, inst: object) -> tuple[str, int, int, tuple[int, ...]]:
    """(role, tp, pp, node of each stage) of one InstancePlacement.to_json, validated."""
    bad = InvalidRequest(f"instance {i} is not {{role, tp, pp, stages: [{{node, gpus}}]}}")
    if not isinstance(inst, dict) or inst.get("role") not in WORKER_ROLES:
        raise bad
    tp, pp, stages = inst.get("tp"), inst.get("pp"), inst.get("stages")
    if not (isinstance(tp, int) and isinstance(pp, int) and tp > 0 and pp > 0):
        raise bad
    if not isinstance(stages, list) or len(stages) != pp:
        raise bad
    for s in stages:
        if not (isinstance(s, dict) and isinstance(s.get("node"), int)):
            raise bad
        if not (isinstance(s.get("gpus"), list) and len(s["gpus"]) == tp):
            raise bad
    return inst["role"], tp, pp, tuple(s["node"] for s in stages)
