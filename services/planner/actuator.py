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
local mesh of processes). distserve/deploy/actuator.py implements it for Kubernetes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from services.common import mesh_tls
from services.common.errors import FailedPrecondition
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


@dataclass(frozen=True)
class ActuatorStatus:
    instances: tuple[Instance, ...] = ()
    changing: bool = False  # a change is being applied
    last_error: str = ""  # the last change that failed, and why ("" when none)
    changes: int = 0  # changes applied since start (failed ones included)

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
        return ActuatorStatus(
            tuple(
                Instance(i.name, i.role, i.state, i.load if i.HasField("load") else None, i.tp or 1)
                for i in pb.instances
            ),
            changing=pb.changing,
            last_error=pb.last_error,
            changes=pb.changes,
        )

    def close(self) -> None:
        self._channel.close()


def common_degree(degrees: list[int]) -> int | None:
    """The most common of a role's instances' tensor degrees (a tie: the larger; none: None):
    the role's degree, also while a re-shard is under way."""
    return max(set(degrees), key=lambda d: (degrees.count(d), d)) if degrees else None


@dataclass(frozen=True)
class Step:
    """One step of a change: `drain` the instance `name`, or `start` one of `role` at `tp`."""

    action: str  # "drain" or "start"
    role: str
    tp: int
    name: str = ""  # the instance drained


def transition(
    instances: list[tuple[str, str, int]],
    counts: Mapping[str, int],
    tp: Mapping[str, int],
    budget: int,
) -> list[Step]:
    """The steps from `instances` ((name, role, tp), the first drained first where there is a
    choice) to `counts` instances per role at degree `tp[role]` (roles not in `counts` keep
    theirs), never over `budget` devices (0: none) and never leaving a role that has an
    instance without one: the surplus drains first; then each missing instance starts,
    once an instance of another degree has drained to make room for it where the budget is
    full (one whose role keeps another instance meanwhile). FailedPrecondition when the budget
    leaves no such order (a role of one instance re-sharded with no room beside it)."""
    live = {name: (role, degree) for name, role, degree in instances}
    order = [name for name, _, _ in instances]
    steps: list[Step] = []

    def drain(name: str) -> None:
        role, degree = live.pop(name)
        steps.append(Step("drain", role, degree, name))

    def of(role: str, degree: int | None = None) -> list[str]:
        """`role`'s live instances (of `degree`, if given), in order."""
        return [
            n
            for n in order
            if n in live and live[n][0] == role and (degree is None or live[n][1] == degree)
        ]

    for role, count in counts.items():
        same = of(role, tp[role])
        for name in same[: max(0, len(same) - count)]:
            drain(name)
    old = [n for n in order if n in live and live[n][0] in counts and live[n][1] != tp[live[n][0]]]
    started = 0
    for role, count in counts.items():
        while len(of(role, tp[role])) < count:
            used = sum(degree for _, degree in live.values())
            if budget and used + tp[role] > budget:
                spare = [n for n in old if n in live and len(of(live[n][0])) > 1]
                spare.sort(key=lambda n: live[n][0] != role)  # this role's own first
                if not spare:
                    raise FailedPrecondition(
                        f"{role} at tp {tp[role]}: no room in a budget of {budget} devices "
                        f"beside the {used} in use, and every instance that could make room is "
                        "its role's last (a role is never left without one): raise the budget "
                        "or re-shard by hand"
                    )
                drain(spare[0])
                continue
            started += 1
            live[f"+{role}-{started}"] = (role, tp[role])
            order.append(f"+{role}-{started}")
            steps.append(Step("start", role, tp[role]))
    for name in old:
        if name in live:
            drain(name)
    return steps
