"""`distserve deploy scale`: what the running Deployments need to become a new placement, as
patch files and the exact `kubectl` commands that apply them (`ReplicaPatches`). It talks to
no cluster itself: apply the commands (or let a controller with the rights do it), and the
gateway's registry shows the change land. It is not an `Actuator`
(services/planner/actuator.py): it takes whole placements, its pools are Deployments of one
role each, it cannot re-shard, and it cannot tell whether a change has landed; the planner acting
in-cluster uses services/planner/k8s_actuator.py instead (`deploy render --planner-acts`).

Only replica counts change this way: a placement whose pools differ in shape (another tensor
degree, another node layout) needs `distserve deploy render` and `kubectl apply -k` again.

Scale-down is a drain: a removed pod gets SIGTERM, deregisters at once, finishes or hands off
its requests and releases its KV within `terminationGracePeriodSeconds` (render.py).
`drain(pod)` chooses which pod goes: it marks the pod with the lowest
`controller.kubernetes.io/pod-deletion-cost`, which the ReplicaSet removes first, and scales
its pool down by one.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from pathlib import Path

from distserve.deploy.options import RenderOptions, gpus_per_node
from distserve.deploy.pools import WorkerPool, select_placement, worker_pools
from services.common.errors import InvalidRequest

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


class ReplicaPatches:
    """Scales the worker Deployments `distserve deploy render` made for `plan`; every change is
    a merge patch under `out_dir` and a command in `commands`."""

    def __init__(self, plan: dict, out_dir: Path, options: RenderOptions | None = None) -> None:
        self.options = options or RenderOptions()
        self.gpus_per_node = gpus_per_node(plan)
        placement = select_placement(plan, self.options.baseline)
        self.pools = {p.name: p for p in worker_pools(placement, self.gpus_per_node)}
        self.out_dir = out_dir
        self.commands: list[str] = []

    def scale(self, pool: str, role: str, count: int) -> None:
        current = self._pool(pool)
        if role != current.role:
            raise InvalidRequest(f"pool {pool!r} runs {current.role} instances, not {role}")
        if count < 0:
            raise InvalidRequest(f"{pool}: a count of instances is >= 0, got {count}")
        self.pools[pool] = replace(current, replicas=count)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"{pool}.replicas.json"
        path.write_text(json.dumps(replicas_patch(count), indent=2) + "\n")
        self.commands.append(
            f"kubectl -n {self.options.namespace} patch deployment {pool} --type merge "
            f"--patch-file {shlex.quote(str(path))}"
        )

    def drain(self, worker: str) -> None:
        """`worker`: a pod's name (its worker id in the gateway's registry)."""
        pool = max(
            (name for name in self.pools if worker.startswith(name + "-")), key=len, default=None
        )
        if pool is None:
            raise InvalidRequest(f"pod {worker!r} belongs to none of {sorted(self.pools)}")
        self.commands.append(
            f"kubectl -n {self.options.namespace} annotate pod {shlex.quote(worker)} "
            f"{DELETION_COST}=-1000 --overwrite"
        )
        self.scale(pool, self.pools[pool].role, max(0, self.pools[pool].replicas - 1))

    def apply(self, plan: dict) -> list[str]:
        """Scale every pool to the placement in `plan`; the commands this added."""
        placement = select_placement(plan, self.options.baseline)
        wanted = {p.name: p for p in worker_pools(placement, self.gpus_per_node)}
        if {n: _shape(p) for n, p in wanted.items()} != {
            n: _shape(p) for n, p in self.pools.items()
        }:
            raise InvalidRequest(
                "the new placement changes the pools' shapes (tensor degree or nodes), not only "
                "their replicas: render it (`distserve deploy render`) and `kubectl apply -k`"
            )
        before = len(self.commands)
        # Down first, then up: a packed cluster has no GPUs for the new pods before.
        for pool in sorted(wanted.values(), key=lambda p: p.replicas - self.pools[p.name].replicas):
            if pool.replicas != self.pools[pool.name].replicas:
                self.scale(pool.name, pool.role, pool.replicas)
        return self.commands[before:]

    def counts(self) -> dict[str, int]:
        """Instances per role as last written (a cluster's own state is the registry's to
        tell)."""
        out: dict[str, int] = {}
        for p in self.pools.values():
            out[p.role] = out.get(p.role, 0) + p.replicas
        return out

    def _pool(self, name: str) -> WorkerPool:
        if name not in self.pools:
            raise InvalidRequest(f"no pool {name!r}: the mesh has {sorted(self.pools)}")
        return self.pools[name]


def replicas_patch(count: int) -> dict:
    """A JSON merge patch (RFC 7386) setting a Deployment's replicas."""
    return {"spec": {"replicas": count}}


def _shape(pool: WorkerPool) -> tuple:
    return (pool.role, pool.tp, pool.pp, pool.node)
