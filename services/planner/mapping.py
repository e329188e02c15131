"""Where instances go: each pipeline stage's GPUs on a node (DistServe §4's node mapping).

`first_fit` for the high-affinity algorithm and the colocated baseline (stages fill nodes in
order, larger segments first); `unit_mapping` for low affinity (stage k of every instance in a
unit on the unit's k-th node, so KV moves over that node's links).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.planner.cluster import ClusterSpec


@dataclass(frozen=True)
class InstancePlacement:
    """One instance and its GPUs: gpus[stage] lists the (node, gpu) of that stage's tp GPUs."""

    role: str
    tp: int
    pp: int
    gpus: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(stage[0][0] for stage in self.gpus)

    def to_json(self) -> dict:
        return {
            "role": self.role,
            "tp": self.tp,
            "pp": self.pp,
            "stages": [{"node": s[0][0], "gpus": [g for _, g in s]} for s in self.gpus],
        }


def first_fit(
    roles: list[tuple[str, int, int]], cluster: ClusterSpec
) -> list[InstancePlacement] | None:
    """Each stage's tp GPUs on one node, stages filling nodes in order; None if they do not fit.

    Larger segments go first (first-fit decreasing), so small ones fill the gaps.
    """
    free = [list(range(cluster.gpus_per_node)) for _ in range(cluster.nodes)]
    order = sorted(range(len(roles)), key=lambda i: -roles[i][1])
    placed: dict[int, InstancePlacement] = {}
    for i in order:
        role, tp, pp = roles[i]
        stages = []
        for _ in range(pp):
            node = next((n for n, gpus in enumerate(free) if len(gpus) >= tp), None)
            if node is None:
                return None
            taken, free[node] = free[node][:tp], free[node][tp:]
            stages.append(tuple((node, g) for g in taken))
        placed[i] = InstancePlacement(role, tp, pp, tuple(stages))
    return [placed[i] for i in range(len(roles))]


def unit_mapping(
    count: int, pp: int, segments: list[tuple[int, int]], cluster: ClusterSpec
) -> list[InstancePlacement]:
    """Low affinity: `count` units, each on pp nodes; stage k of every instance of a unit on the
    unit's k-th node. segments: (tp, instances) of prefill, then of decode."""
    used = sum(tp * n for tp, n in segments)
    per_group = cluster.gpus_per_node // used
    out = []
    for u in range(count):
        group, slot = divmod(u, per_group)
        nodes = [group * pp + k for k in range(pp)]
        offset = slot * used
        for role, (tp, n) in zip(("prefill", "decode"), segments, strict=True):
            for _ in range(n):
                stages = tuple(tuple((node, offset + g) for g in range(tp)) for node in nodes)
                out.append(InstancePlacement(role, tp, pp, stages))
                offset += tp
    return out
