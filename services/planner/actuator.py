"""What applies a placement: the planner decides how many instances of each role a pool needs,
and of what tensor degree; an actuator makes the running mesh so.

One small interface, `Actuator`: `scale(pool, role, count)` (start instances, or drain the
least busy ones away), `apply(pool, counts, reason, tp)` (several roles at once; `tp`: each
role's tensor degree, its instances of another one replaced), `drain(worker)` (one instance:
it takes no new requests, finishes or hands off what it has, releases its held KV, then stops)
and `status()` (the instances by role, degree and state, and whether a change is still being
applied: no new decision is taken while one is).
The planner process holds a `RemoteActuator` (below): the same interface over gRPC, to the
`Actuator` service that `distserve up` serves (distserve/local_actuator.py, which drives the
local mesh of processes and follows services/planner/transition.py's steps). On Kubernetes
the planner holds a `KubernetesActuator` (services/planner/k8s_actuator.py: the worker
Deployments through the cluster's API) when rendered with `--planner-acts`.
`ActuatorStatus` and `Instance` convert to and from their messages here (`to_pb`/`from_pb`),
the one place either side of the `Actuator` service does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from services.common import mesh_tls
from services.common.gen.distserve.v1 import common_pb2, planner_pb2, planner_pb2_grpc


@dataclass(frozen=True)
class Instance:
    name: str
    role: str
    state: str  # "serving", "starting" or "draining"
    # its last reported load (a `WorkerLoad`, as the gateway has it); None: not known (a
    # starting worker, or an actuator that cannot see loads)
    load: common_pb2.WorkerLoad | None = None
    tp: int = 1  # its tensor degree

    @classmethod
    def from_pb(cls, pb: planner_pb2.ActuatorInstance) -> Instance:
        return cls(pb.name, pb.role, pb.state, pb.load if pb.HasField("load") else None, pb.tp or 1)

    def to_pb(self) -> planner_pb2.ActuatorInstance:
        return planner_pb2.ActuatorInstance(
            name=self.name, role=self.role, state=self.state, load=self.load, tp=self.tp
        )


@dataclass(frozen=True)
class ActuatorStatus:
    instances: tuple[Instance, ...] = ()
    changing: bool = False  # a change is being applied
    last_error: str = ""  # the last change that failed, and why ("" when none)
    changes: int = 0  # changes applied since start (failed ones included)

    @classmethod
    def from_pb(cls, pb: planner_pb2.ActuatorStatus) -> ActuatorStatus:
        return cls(
            tuple(Instance.from_pb(i) for i in pb.instances),
            changing=pb.changing,
            last_error=pb.last_error,
            changes=pb.changes,
        )

    def to_pb(self) -> planner_pb2.ActuatorStatus:
        return planner_pb2.ActuatorStatus(
            instances=[i.to_pb() for i in self.instances],
            changing=self.changing,
            last_error=self.last_error,
            changes=self.changes,
        )

    def count(self, role: str) -> int:
        """Instances of `role` serving or starting (those draining are on their way out)."""
        return sum(1 for i in self.instances if i.role == role and i.state != "draining")

    def describe(self) -> str:
        """e.g. "decode x1 (tp 2), prefill x2" (instances serving or starting)."""
        roles = sorted({i.role for i in self.instances if i.state != "draining"})
        parts = []
        for role in roles:
            degree = self.tp(role) or 1
            parts.append(f"{role} x{self.count(role)}" + (f" (tp {degree})" if degree > 1 else ""))
        return ", ".join(parts) or "no instances"

    def tp(self, role: str) -> int | None:
        """The tensor degree of `role`'s instances serving or starting (the most common one
        while a re-shard is under way; None: the role has none)."""
        return common_degree(
            [i.tp for i in self.instances if i.role == role and i.state != "draining"]
        )

    def loads(self) -> dict[str, common_pb2.WorkerLoad]:
        """Each role's load over its serving instances that report one, as one `WorkerLoad`:
        queues, running sequences and KV blocks summed; the decode step time their mean."""
        out = {}
        for role in sorted({i.role for i in self.instances}):
            loads = [
                i.load for i in self.instances if i.role == role and i.state == "serving" and i.load
            ]
            if not loads:
                continue
            total = common_pb2.WorkerLoad(kv_block_size=loads[0].kv_block_size)
            for name in _SUMMED:
                setattr(total, name, sum(getattr(x, name) for x in loads))
            steps = [x.decode_step_ms for x in loads if x.decode_step_ms > 0]
            total.decode_step_ms = sum(steps) / len(steps) if steps else 0.0
            out[role] = total
        return out


_SUMMED = (
    "queued_prompt_tokens",
    "running_seqs",
    "waiting_seqs",
    "free_kv_blocks",
    "total_kv_blocks",
    "pending_pulls",
    "held_kv_handles",
)


class Actuator(Protocol):
    def scale(self, pool: str, role: str, count: int) -> None: ...

    def apply(
        self,
        pool: str,
        counts: Mapping[str, int],
        reason: str = "",
        tp: Mapping[str, int] | None = None,
    ) -> None: ...

    def drain(self, worker: str) -> None: ...

    def status(self) -> ActuatorStatus: ...


class RemoteActuator:
    """An `Actuator` served elsewhere (`distserve up`'s, distserve/local_actuator.py), over
    gRPC. `scale` and `apply` return once the change has started: `status().changing` says
    when it is done."""

    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        self._channel = mesh_tls.channel(address)
        self._stub = planner_pb2_grpc.ActuatorStub(self._channel)
        self.timeout_s = timeout_s

    def scale(self, pool: str, role: str, count: int) -> None:
        self.apply(pool, {role: count})

    def apply(
        self,
        pool: str,
        counts: Mapping[str, int],
        reason: str = "",
        tp: Mapping[str, int] | None = None,
    ) -> None:
        request = planner_pb2.ApplyRequest(
            pool=pool, counts=dict(counts), reason=reason, tp=dict(tp or {})
        )
        self._stub.Apply(request, timeout=self.timeout_s)

    def drain(self, worker: str) -> None:
        self._stub.Drain(planner_pb2.DrainRequest(worker_id=worker), timeout=600)

    def status(self) -> ActuatorStatus:
        pb = self._stub.Status(planner_pb2.ActuatorStatusRequest(), timeout=self.timeout_s)
        return ActuatorStatus.from_pb(pb)

    def close(self) -> None:
        self._channel.close()


def common_degree(degrees: list[int]) -> int | None:
    """The most common of a role's instances' tensor degrees (a tie: the larger; none: None):
    the role's degree, also while a re-shard is under way."""
    return max(set(degrees), key=lambda d: (degrees.count(d), d)) if degrees else None
